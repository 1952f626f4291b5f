"""Publishing: a verified build moved into place in one step.

A build is assembled in a staging directory beside its destination (same
filesystem, so the final move is a rename) while holding a lock on the
destination; a failed or killed build leaves any previous artifact untouched,
and the next build removes what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..artifact import STAGING_PREFIX, foreign_entries
from ..config.paths import check_writable
from ..errors import ConfigError, cleanup_uninterrupted
from ..runtime.hashing import altered_digest

log = logging.getLogger(__name__)


@contextlib.contextmanager
def build_lock(output_dir: Path) -> Iterator[None]:
    """Serialise builds of one output directory across processes; builds of
    other directories run side by side. The lock dies with its process, and
    its file goes with it: a build leaves nothing beside its output (inside
    a model's directory, say) but the output itself."""
    created = not output_dir.parent.exists()
    lock_path = writable_parent(output_dir) / f".{output_dir.name}.lock"
    lock = _locked(lock_path, output_dir)
    try:
        # Staging directories of this output dir are ours to remove: the lock
        # is held, so whatever left them was killed.
        for stale in output_dir.parent.glob(f"{_staging_prefix(output_dir)}*"):
            log.info("removing %s, left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock_path.unlink()  # while held: a waiter on this file sees it gone and takes the next one
        lock.close()
        if created:  # a failed first build leaves no empty folder behind
            with contextlib.suppress(OSError):
                output_dir.parent.rmdir()


def _locked(lock_path: Path, output_dir: Path) -> IO[str]:
    """`lock_path` opened and locked, the file the path names when the lock
    was taken (its holder removes it on release; a waiter then tries anew)."""
    while True:
        try:
            lock = open(lock_path, "a")  # noqa: SIM115 - held past this function, closed by build_lock
        except FileNotFoundError:  # a failed build of a sibling removed the folder it had made: make it again
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another build of %s to finish (%s)", output_dir, lock_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()


def writable_parent(output_dir: Path) -> Path:
    """The output directory's parent, created."""
    check_writable(output_dir)
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("output_dir", str(output_dir), f"cannot be written ({exc.strerror or exc})") from None
    return output_dir.parent


def _staging_prefix(output_dir: Path) -> str:
    """Readable, and unique to this output dir: the digest keeps `mlp`'s staging
    from matching `mlp-seed_1`'s when stale ones are cleaned."""
    digest = hashlib.sha256(output_dir.name.encode()).hexdigest()[:8]
    return f"{STAGING_PREFIX}{output_dir.name}.{digest}~"


@contextlib.contextmanager
def staging_dir(output_dir: Path) -> Iterator[Path]:
    """A fresh directory next to `output_dir`, removed unless published."""
    path = Path(tempfile.mkdtemp(prefix=_staging_prefix(output_dir), dir=writable_parent(output_dir)))
    try:
        yield path
    finally:
        with cleanup_uninterrupted():
            shutil.rmtree(path, ignore_errors=True)


def publish(staging: Path, output_dir: Path) -> None:
    """Put `staging` at `output_dir` in one atomic step: a reader sees the old
    artifact or the new one, never neither and never a mix."""
    _seal_modes(staging)
    retiring = _staging_prefix(output_dir)  # where the old artifact goes without an atomic swap
    # Digests too, here only: what was checked by name and size before the
    # work may have been replaced since, and this swap is the one that deletes.
    in_the_way = foreign_entries(output_dir, lambda path, record: altered_digest(path, record) is not None)
    if in_the_way:  # appeared since the config was checked: never swap someone's files out
        raise ConfigError(
            "output_dir",
            str(output_dir),
            f"now holds entries that are not part of a flashrt_build artifact ({', '.join(in_the_way[:5])}); "
            "nothing was published",
        )
    if not output_dir.exists():
        os.rename(staging, output_dir)
        return
    try:  # an atomic swap of the two paths (Linux renameat2)
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not in this libc
        renameat2 = None
    swapped = renameat2 is not None and renameat2(
        _AT_FDCWD, os.fsencode(staging), _AT_FDCWD, os.fsencode(output_dir), _RENAME_EXCHANGE
    ) == 0  # fmt: skip
    code = ctypes.get_errno() if renameat2 is not None and not swapped else 0
    if code and code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # unsupported here: two renames
        raise OSError(code, os.strerror(code), str(output_dir))
    if swapped:
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old artifact
    else:  # a filesystem without RENAME_EXCHANGE: two renames, a moment apart
        retired = Path(tempfile.mkdtemp(prefix=retiring, dir=output_dir.parent))
        os.rename(output_dir, retired / "old")
        os.rename(staging, output_dir)
        shutil.rmtree(retired, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _seal_modes(directory: Path) -> None:
    """mkdtemp and some writers create owner-only modes; an artifact's
    directory gets the mode the umask gives ordinary directories (a rebuild
    replaces it, `store clean` unlinks its store's files), its files the
    umask's read modes and no write bit: they are hard links into the store
    (`store.py`), so an edit in place would alter the stored build too."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o444 & ~umask)
