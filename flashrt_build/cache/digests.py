"""The sha256 of files a build reads or writes, remembered by what `stat`
says of them, the way git's index remembers its files: a file whose path,
size, mtime, ctime and inode are unchanged is not read again, so an
up-to-date check over gigabytes of checkpoint shards costs a few `stat`
calls. The ctime is the kernel's: a copy that keeps the mtime (`cp -p`,
`touch -r`) still changes it.

Kept in `<output_root>/.store/digests.json`. A file changed within a second
of being hashed could keep its mtime on a coarse clock (git's "racy" case):
its digest is trusted only once it is older than that.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..runtime.hashing import file_sha256, hashing_threads

DIGESTS = "digests.json"
DIGESTS_STAGING = ".digests-"  # its next version, written beside it, then renamed over it
_RACY_NS = 1_000_000_000  # a digest is trusted once the file is this much older than the hashing
# Digests taken in this process, by path: the command line's up-to-date check
# and the build it hands over to read each file once between them.
_SEEN: dict[str, dict[str, int | str]] = {}


class DigestCache:
    """sha256 by path, re-read only when a file's stat changed. `root`: the
    store directory it is kept in; None keeps nothing between processes."""

    def __init__(self, root: Path | None) -> None:
        self.path = None if root is None else Path(root) / DIGESTS
        self._entries: dict[str, dict[str, int | str]] = {}
        self._changed = False
        self.hashed: list[Path] = []  # files read this time (not found or stale in the cache)
        if self.path is not None and self.path.is_file():  # a FIFO there would block the read
            try:
                loaded = json.loads(self.path.read_text())
                self._entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                pass

    def sha256(self, path: Path) -> str:
        return self.sha256_all([path])[0]

    def sha256_all(self, paths: Iterable[Path]) -> list[str]:
        """The digest of each file; those not remembered are hashed one per core."""
        paths = [Path(p).resolve() for p in paths]
        stats = [p.stat() for p in paths]
        known = [self._lookup(p, st) for p, st in zip(paths, stats, strict=True)]
        missing = [i for i, digest in enumerate(known) if digest is None]
        if missing:
            with ThreadPoolExecutor(min(len(missing), hashing_threads())) as pool:
                fresh = list(pool.map(file_sha256, [paths[i] for i in missing]))
            now = time.time_ns()
            for i, digest in zip(missing, fresh, strict=True):
                known[i] = digest
                self.remember(paths[i], digest, stats[i], now)
                self.hashed.append(paths[i])
        return [d for d in known if d is not None]

    def known(self, path: Path) -> str | None:
        """The remembered digest of `path` if its stat still matches, else None (nothing is read)."""
        path = Path(path).resolve()
        return self._lookup(path, path.stat())

    def remember(self, path: Path, digest: str, stat: os.stat_result | None = None, at_ns: int | None = None) -> None:
        """Record a digest computed elsewhere (a build hashing what it wrote)."""
        stat = stat or path.stat()
        entry: dict[str, int | str] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns,
            "inode": stat.st_ino,
            "hashed_ns": at_ns if at_ns is not None else time.time_ns(),
            "sha256": digest,
        }
        self._entries[str(Path(path).resolve())] = _SEEN[str(Path(path).resolve())] = entry
        self._changed = True

    def _lookup(self, path: Path, stat: os.stat_result) -> str | None:
        seen = _SEEN.get(str(path))
        if seen and _same_stat(seen, stat):
            return str(seen["sha256"])
        entry = self._entries.get(str(path))
        if not entry or not _same_stat(entry, stat):
            return None
        settled = max(stat.st_mtime_ns, stat.st_ctime_ns) + _RACY_NS < int(entry.get("hashed_ns", 0))
        return str(entry["sha256"]) if settled else None

    def save(self, create: bool = False) -> None:
        """Write the digests back (whole, by an atomic rename). Into an existing
        store only, unless `create` (a build that succeeded): a command refused
        for its config creates nothing. An optimisation, so a store that cannot
        be written is left as it is."""
        if self.path is None or not self._changed or not (create or self.path.parent.is_dir()):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Another build may have remembered files meanwhile: keep theirs too.
            try:
                on_disk = json.loads(self.path.read_text()) if self.path.is_file() else {}
            except (OSError, ValueError):
                on_disk = {}
            merged = {**(on_disk if isinstance(on_disk, dict) else {}), **self._entries}
            merged = {path: entry for path, entry in merged.items() if Path(path).exists()}
            fd, tmp = tempfile.mkstemp(prefix=DIGESTS_STAGING, dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, separators=(",", ":"))
            os.replace(tmp, self.path)
            self._changed = False
        except OSError:
            pass


def _same_stat(entry: dict[str, int | str], stat: os.stat_result) -> bool:
    return (entry.get("size"), entry.get("mtime_ns"), entry.get("ctime_ns"), entry.get("inode")) == (
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ctime_ns,
        stat.st_ino,
    )
