"""The paths a config names, checked before any work: the output locations
can be created and written, a checkpoint read, a config directory listed.
Each problem is a ConfigError naming the key and the path; nothing is created."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..errors import ConfigError


def check_writable(path: Path, key: str = "output_dir", beside: bool = True) -> None:
    """Refuse, before any work and creating nothing, a directory that could
    not be created or written, naming its config key: an existing file in the
    way, a missing or read-only filesystem, no permission. Probed by creating
    (and at once removing) a nameless file where the build will write: beside
    an existing output dir (staging, lock), inside an output root."""
    where = path.parent if beside and path.is_dir() else path
    while not where.exists() and where != where.parent:
        where = where.parent
    if path.exists() and not path.is_dir():
        raise ConfigError(key, str(path), "exists and is not a directory")
    if not where.is_dir():
        raise ConfigError(key, str(path), f"cannot be created: {where} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(key, str(path), f"cannot be written: creating a file in {where} fails ({why})") from None


def check_readable_file(key: str, value: str, path: Path) -> None:
    """A file the build will read: there, a file, readable."""
    if not path.exists():
        raise ConfigError(key, value, f"no such file ({path})")
    if not path.is_file():
        raise ConfigError(key, value, f"is a directory, not a file ({path})")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(key, value, f"cannot be read ({exc.strerror or exc})") from None


def check_config_dir(key: str, path: str | Path) -> None:
    """A directory of the user's configs must be one: Hydra would say only
    that it was "not found"."""
    if not Path(path).exists():
        raise ConfigError(key, str(path), "no such directory")
    if not Path(path).is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory of configs")
