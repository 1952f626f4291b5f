"""A content-addressed store under the output root.

- `packages/<graph_key>/`: external-weights packages, which do not depend on
  weight values, so builds that differ only in checkpoint or seed share one compile;
- `methods/<method_key>/`: one method's compiled model of a package with several,
  so changing one method recompiles that method only (no output directory
  links them, so `clean` removes them);
- `artifacts/<build_key>/`: whole artifacts, so identical builds into several
  output directories (a sweep, a release tree) are built once.

Output directories are filled by hard links (copies across filesystems), never
by symbolic links, so cleaning the store breaks no artifact. Stored files have
no write bit (nor, being the same files, the outputs linked to them): an edit
in place would alter every build that links them. `prune` (`store clean`)
removes only entries: anything else under `.store/` (a folder of the user's,
a file, a link, `.store` itself a link, never walked) is named as left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..artifact import MANIFEST, PACKAGE, STORE_DIR
from ..runtime.hashing import file_sha256
from .digests import DIGESTS, DIGESTS_STAGING


def link_or_copy(source: Path, dest: Path) -> None:
    """A hard link survives removal of the other name; copy across filesystems."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def read_only(path: Path) -> None:
    """No write bit on a stored file, or on the output files that are its
    other names: an edit in place would alter every build linked to it.
    Removing it needs only its directory's write bit (`prune`, a rebuild)."""
    path.chmod(path.stat().st_mode & ~0o222)


KINDS = ("packages", "methods", "artifacts")  # the store's folders of entries


class Store:
    """`<output_root>/.store/{packages,artifacts}/<key>/` with a `sha256` list."""

    def __init__(self, output_root: Path) -> None:
        self.root = Path(output_root) / STORE_DIR

    def get(self, kind: str, key: str) -> Path | None:
        """The entry for `key`, if present and every file in it intact."""
        entry = self.root / kind / key
        try:
            recorded = dict(line.split("  ", 1)[::-1] for line in (entry / "sha256").read_text().splitlines())
        except (OSError, ValueError):
            return None
        if all((entry / name).is_file() and file_sha256(entry / name) == sha for name, sha in recorded.items()):
            return entry
        shutil.rmtree(entry, ignore_errors=True)  # damaged: rebuild rather than trust it
        return None

    def put(self, kind: str, key: str, files: list[Path]) -> None:
        """Keep `files` under `key`; the entry appears whole or not at all."""
        entry = self.root / kind / key
        if entry.exists():
            return
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=entry.parent))
        except OSError:
            return  # the store is an optimisation: a read-only root just goes without
        try:
            lines = []
            for path in files:
                link_or_copy(path, staging / path.name)
                read_only(staging / path.name)
                lines.append(f"{file_sha256(path)}  {path.name}")
            (staging / "sha256").write_text("\n".join(lines) + "\n")
            read_only(staging / "sha256")
            os.rename(staging, entry)
        except OSError:
            pass  # another build stored it first
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def package(self, key: str, kind: str = "packages") -> Path | None:
        """A stored package: by graph key (`packages`) or, one method's model, by method key (`methods`)."""
        entry = self.get(kind, key)
        return entry / PACKAGE if entry else None

    def prune(self, everything: bool = False) -> tuple[list[Path], list[tuple[Path, str]]]:
        """Remove entries no output directory links to any more (or all of
        them). Only store entries are ever removed: a directory holding its
        `sha256` list and the files it lists. Anything else under the store
        is named as left, and a store that is a link is not walked at all.
        Returns (removed, [(left, why)])."""
        removed: list[Path] = []
        left = self._not_the_stores()
        if left and left[0][0] == self.root:
            return removed, left
        for kind in KINDS:
            folder = self.root / kind
            if folder.is_symlink() or not folder.is_dir():
                continue
            for entry in sorted(folder.iterdir()):
                why = _not_an_entry(entry)
                if why is not None:
                    left.append((entry, why))
                    continue
                files = [p for p in entry.iterdir() if p.name not in ("sha256", MANIFEST)]
                if everything or all(p.stat().st_nlink <= 1 for p in files):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed, left

    def _not_the_stores(self) -> list[tuple[Path, str]]:
        """What is under the store's own folder but not the store's, with why:
        the folder itself when it is a link (to a directory of the user's,
        whose entries are not the store's to remove) or a file."""
        if self.root.is_symlink():
            return [(self.root, f"a symbolic link to {os.path.realpath(self.root)}, not the store's own folder: "
                                 "nothing under it was removed")]  # fmt: skip
        if not self.root.is_dir():
            return [(self.root, "a file, not the store's folder")] if self.root.exists() else []
        left = []
        for path in sorted(self.root.iterdir()):
            if path.name in KINDS:
                if path.is_symlink() or not path.is_dir():
                    left.append((path, "a symbolic link or a file where the store keeps a folder of its own"))
            elif path.name != DIGESTS and not path.name.startswith(DIGESTS_STAGING):
                left.append((path, f"not the store's (it holds {', '.join(KINDS)} and {DIGESTS})"))
        return left


def _not_an_entry(entry: Path) -> str | None:
    """Why `entry` is not a store entry `put` made, or None when it is one."""
    if entry.is_symlink():
        return "a symbolic link, not a store entry"
    if not entry.is_dir():
        return "a file, not a store entry"
    listing = entry / "sha256"
    if listing.is_symlink() or not listing.is_file():
        return "not a store entry (it has no sha256 list)"
    try:
        listed = {line.split("  ", 1)[1] for line in listing.read_text().splitlines() if line}
    except (OSError, UnicodeDecodeError, IndexError):
        return "not a store entry (its sha256 list does not parse)"
    extra = sorted(p.name for p in entry.iterdir() if p.name != "sha256" and p.name not in listed)
    if extra or any((entry / name).is_symlink() or not (entry / name).is_file() for name in listed):
        return f"not a store entry as the store made it (it holds {', '.join(extra) or 'links or folders'})"
    return None
