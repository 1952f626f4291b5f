"""The temp dir (TMPDIR): where Inductor compiles and every loaded package
unpacks its libraries. Imports no torch: the build's config checks it too."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def check_temp_dir() -> None:
    """The temp dir (TMPDIR) holds Inductor's compile and every loaded package's
    unpacked files; one that is not a writable directory fails the build late
    and obscurely, so refuse it first."""
    value = os.environ.get("TMPDIR")
    if not value:
        return
    why = None
    if not Path(value).is_dir():
        why = "no such directory" if not Path(value).exists() else "is not a directory"
    elif not os.access(value, os.W_OK | os.X_OK) or not _can_create_in(value):  # root's access() says yes to /proc
        why = "is not writable"
    if why:
        raise ConfigError(
            "TMPDIR", value, f"{why}: builds compile, and packages load, in the temp dir", "environment variable"
        )


def _can_create_in(directory: str) -> bool:
    """Whether a directory takes a new folder, as torch's unpacking makes one."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".flashrt-probe-", dir=directory))
    except OSError:
        return False
    return True
