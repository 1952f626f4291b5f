"""What a build's output directory holds, and how to tell one from a folder
of someone else's files. A build replaces its output directory whole, so
this decides what it may replace.

Imports nothing of flashrt_build and no torch: every layer uses it, the
config checks included.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "flashrt_build.manifest/1"
MANIFEST = "manifest.json"
PACKAGE = "model.pt2"
SIDECAR = "weights.safetensors"
STATE = "state.safetensors"  # initial values of buffers a stateful module mutates
ARTIFACT_FILES = (PACKAGE, SIDECAR, STATE, MANIFEST)


def foreign_entries(directory: Path) -> list[str] | None:
    """None when `directory` may be replaced by a build: it is absent, empty,
    or holds a complete build of this tool (a manifest of this schema) and
    nothing but that build's files. Else the names of what is in the way,
    sorted: a folder of the user's files, a checkout, a half-copied build."""
    if not directory.is_dir():
        return None
    entries = sorted(entry.name for entry in directory.iterdir())
    if not entries:
        return None
    if not _is_manifest(directory / MANIFEST):
        return entries
    return [name for name in entries if name not in ARTIFACT_FILES] or None


def _is_manifest(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("schema") == SCHEMA
