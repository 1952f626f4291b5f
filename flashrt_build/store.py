"""A content-addressed store of compiled packages under the output root.

External-weights packages do not depend on weight values, so builds that
differ only in their checkpoint or seed share one compile: the package is kept
here under its graph key and hard-linked into each output directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .manifest import PACKAGE, file_sha256

STORE_DIR = ".store"


def link_or_copy(source: Path, dest: Path) -> None:
    """A hard link survives removal of the other name; copy across filesystems."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


class PackageStore:
    """`<output_root>/.store/packages/<graph_key>/{model.pt2, sha256}`."""

    def __init__(self, output_root: Path) -> None:
        self.root = Path(output_root) / STORE_DIR / "packages"

    def get(self, graph_key: str) -> Path | None:
        """The stored package for `graph_key`, if present and intact."""
        entry = self.root / graph_key
        try:
            recorded = (entry / "sha256").read_text().strip()
        except OSError:
            return None
        package = entry / PACKAGE
        if package.is_file() and file_sha256(package) == recorded:
            return package
        shutil.rmtree(entry, ignore_errors=True)  # damaged: rebuild rather than trust it
        return None

    def put(self, graph_key: str, package: Path, sha256: str) -> None:
        """Keep `package` under `graph_key`; the entry appears whole or not at all."""
        entry = self.root / graph_key
        if entry.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{graph_key[:12]}-", dir=self.root))
        try:
            link_or_copy(package, staging / PACKAGE)
            (staging / "sha256").write_text(sha256 + "\n")
            os.rename(staging, entry)
        except OSError:
            pass  # another build stored it first, or the root is read-only: the store is an optimisation
        finally:
            shutil.rmtree(staging, ignore_errors=True)
