"""What a build's output directory holds and how a package is called: file
names, the manifest's schema id, the package's calling conventions (model
names, threaded state, the default method, its float32 policy), and how to
tell a build from a folder of someone else's files (a build replaces its
output directory whole, so this decides what it may replace).

Imports nothing of flashrt_build and no torch: every layer uses it, the
config checks and the runtime included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SCHEMA = "flashrt_build.manifest/1"
MANIFEST = "manifest.json"
STORE_DIR = ".store"  # under the output root: the content-addressed store (cache/store.py)
STAGING_PREFIX = ".staging-"  # a build being assembled beside its output directory (cache/publish.py)
PACKAGE = "model.pt2"
SIDECAR = "weights.safetensors"
STATE = "state.safetensors"  # initial values of buffers a stateful module mutates
ARTIFACT_FILES = (PACKAGE, SIDECAR, STATE, MANIFEST)

# The model inside the .pt2 of a package with one entry point (AOTInductor's
# default name); a package of several holds one model per method, by its name.
SINGLE_MODEL = "model"
# The keyword argument that carries a stateful module's mutated buffers into
# and out of its package: the package's calling convention.
STATE_KWARG = "flashrt_state"


def default_method(methods: Mapping[str, str]) -> str:
    """What `m(...)` calls, of {entry point: the module method it runs}: the
    one that runs the module's forward, else the first."""
    return next((name for name, attr in methods.items() if attr == "forward"), next(iter(methods)))


def tf32_policy(device: str, dtype: str | None, tf32: bool | None) -> bool | None:
    """The float32 precision a target's calls run under: TF32 on or off for a
    float32 CUDA target; None for any other, whose calls leave torch's flags
    alone (bf16 and fp16 matmuls never read them)."""
    return bool(tf32) if device.startswith("cuda") and dtype == "float32" else None


def written_files(manifest: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """The files a build wrote into its output directory, by name, each with
    its manifest record (`sha256`, `bytes`; None for the manifest itself), as
    the manifest lists them: a baked build lists no sidecar."""
    files: dict[str, Mapping[str, Any] | None] = {MANIFEST: None}
    for section in (manifest.get("package"), manifest.get("weights"), manifest.get("state")):
        if isinstance(section, Mapping) and isinstance(section.get("file"), str):
            files[section["file"]] = section
    for record in manifest.get("files") or []:  # files copied beside the package (a tokenizer)
        if isinstance(record, Mapping) and isinstance(record.get("file"), str):
            files[record["file"]] = record
    return files


def foreign_entries(
    directory: Path, altered: Callable[[Path, Mapping[str, Any]], bool] | None = None
) -> list[str] | None:
    """None when `directory` may be replaced by a build: it is absent, empty,
    or holds a complete build of this tool (a manifest of this schema) and
    nothing but the files that manifest says the build wrote, each of the size
    it recorded (and, given `altered`, not altered since). Else what is in the
    way, sorted: a folder of the user's files, a checkout, a half-copied build,
    a file of the user's that has an artifact's name."""
    if not directory.is_dir():
        return None
    entries = sorted(entry.name for entry in directory.iterdir())
    if not entries:
        return None
    manifest = _read_manifest(directory / MANIFEST)
    if manifest is None:
        return entries
    written = written_files(manifest)
    foreign = []
    for name in entries:
        if name not in written:
            foreign.append(name)
        elif (record := written[name]) is not None and _not_as_written(directory / name, record, altered):
            foreign.append(f"{name} (not the file its build wrote)")
    return foreign or None


def _not_as_written(
    path: Path, record: Mapping[str, Any], altered: Callable[[Path, Mapping[str, Any]], bool] | None
) -> bool:
    if path.is_symlink() or not path.is_file():
        return True
    size = record.get("bytes")
    if isinstance(size, int) and path.stat().st_size != size:
        return True
    return altered is not None and isinstance(record.get("sha256"), str) and altered(path, record)


def build_in(directory: Path) -> dict[str, Any] | None:
    """The manifest of the build `directory` holds, or None where it holds none."""
    return _read_manifest(directory / MANIFEST)


def enclosing_build(path: Path) -> Path | None:
    """The artifact folder `path` would be inside, or None: an artifact
    holding entries its build did not write refuses to serve, so nothing of
    this tool's is written into one."""
    for parent in Path(os.path.abspath(path)).parents:
        if build_in(parent) is not None:
            return parent
    return None


def _read_manifest(path: Path) -> dict[str, Any] | None:
    if path.is_symlink() or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("schema") == SCHEMA else None
