"""The manifest: what was built, from what, with what, and how it verified.

Written last into the staging directory: its presence means a build is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ..artifact import MANIFEST, SCHEMA
from ..errors import ArtifactError

# The keyword argument that carries a stateful module's mutated buffers into and
# out of its package (the package's calling convention).
STATE_KWARG = "flashrt_state"


# A file's record also holds the sha256 of each slice of this many bytes: one
# sha256 runs at about 1 GB/s on one core, slower than a disk reads, and the
# slices can be checked on every core at once.
CHUNK_BYTES = 32 << 20


def file_sha256(path: Path) -> str:
    return range_sha256(path, (0, sys.maxsize))  # to the end of the file


def range_sha256(path: Path, span: tuple[int, int]) -> str:
    """sha256 of `span` = (offset, length) bytes of a file (fewer if it ends first), read in 1 MiB blocks."""
    offset, length = span
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            block = os.pread(fd, min(1 << 20, end - offset), offset)
            if not block:
                break  # the file is shorter than the span: the digest will not match
            digest.update(block)  # hashlib releases the GIL for blocks this size
            offset += len(block)
    finally:
        os.close(fd)
    return digest.hexdigest()


def chunk_spans(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(chunk_bytes, size - start)) for start in range(0, size, chunk_bytes)] or [(0, 0)]


def hashing_threads() -> int:
    return len(os.sched_getaffinity(0))


def file_record(path: Path, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """A manifest's record of a file's bytes: its sha256 and size, and the
    sha256 of each `chunk_bytes` slice, which a load checks in parallel."""
    size = path.stat().st_size
    spans = chunk_spans(size, chunk_bytes)
    with ThreadPoolExecutor(min(len(spans) + 1, hashing_threads())) as pool:
        whole = pool.submit(file_sha256, path)
        # One chunk is the whole file: its digest is the file's.
        chunks = list(pool.map(partial(range_sha256, path), spans)) if len(spans) > 1 else None
    digest = whole.result()
    return {"sha256": digest, "bytes": size, "chunk_bytes": chunk_bytes, "chunk_sha256": chunks or [digest]}


def altered_digest(path: Path, record: Mapping[str, Any]) -> str | None:
    """None when `path` holds the bytes its manifest record describes, else
    the file's sha256 (for the refusal). With chunk digests (manifests since
    they were added), the chunks are hashed on every core, and the whole file
    only when they disagree, to name its digest."""
    chunks = record.get("chunk_sha256")
    if chunks and record.get("chunk_bytes") and path.stat().st_size == record.get("bytes"):
        spans = chunk_spans(record["bytes"], record["chunk_bytes"])
        if len(spans) == len(chunks):
            with ThreadPoolExecutor(min(len(spans), hashing_threads())) as pool:
                found = list(pool.map(partial(range_sha256, path), spans))
            if found == chunks:
                return None
    digest = file_sha256(path)
    return None if digest == record["sha256"] else digest


def canonical_sha256(value: Any) -> str:
    """sha256 of stable JSON (sorted keys, no whitespace): the same value hashes the same."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def config_sha256(config: Any) -> str:
    return canonical_sha256(config)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and check a manifest; a missing, broken or foreign one is refused."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist: {directory} holds no complete build")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path} has schema {found!r}, expected {SCHEMA!r}")
    return manifest


def method_bindings(tensors: list[dict[str, Any]], method: str) -> dict[str, str]:
    """The names a method's model binds, each mapped to its entry in
    `weights.tensors` (and the sidecar). A package of several methods records
    per entry which methods bind it, and by which name."""
    return {
        (entry["methods"][method] if "methods" in entry else entry["fqn"]): entry["fqn"]
        for entry in tensors
        if "methods" not in entry or method in entry["methods"]
    }


def manifest_methods(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each entry point of a package, by name: its module method, model in the
    .pt2, inputs, constant kwargs and threaded state. Manifests written before
    packages had several describe one forward."""
    if "methods" in manifest:
        return manifest["methods"]
    return {
        "forward": {
            "method": "forward",
            "model": "model",
            "inputs": manifest["inputs"],
            "outputs": manifest["outputs"],
            "kwargs": dict(manifest["config"]["module"].get("kwargs") or {}),
            "state": [t["fqn"] for t in (manifest.get("state") or {}).get("tensors", [])],
        }
    }
