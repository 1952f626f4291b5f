"""Stage 7: move a verified build into place in one step.

A build is assembled in a staging directory beside its destination (same
filesystem, so the final move is a rename); a failed build removes its staging
directory and leaves any previous artifact untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import ConfigError

STAGING_PREFIX = ".staging-"
RETIRED_PREFIX = ".retired-"


@contextlib.contextmanager
def staging_dir(output_dir: Path) -> Iterator[Path]:
    """A fresh directory next to `output_dir`, removed unless published."""
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{output_dir.name}-", dir=output_dir.parent))
    except OSError as exc:
        raise ConfigError("output_dir", str(output_dir), f"cannot be written ({exc.strerror})") from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish(staging: Path, output_dir: Path) -> None:
    """Replace `output_dir` with `staging`; the old one survives until the swap."""
    _make_readable(staging)
    retired = None
    if output_dir.exists():
        retired = Path(tempfile.mkdtemp(prefix=f"{RETIRED_PREFIX}{output_dir.name}-", dir=output_dir.parent))
        os.rename(output_dir, retired / output_dir.name)
    os.rename(staging, output_dir)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp and some writers create owner-only modes; artifacts get the
    modes the umask gives ordinary files and directories."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
