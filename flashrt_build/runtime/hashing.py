"""sha256 of an artifact's files, whole and in 32 MiB chunks that a load
checks on every core, and of JSON values (keys, configs); a listed file
refused once altered. No torch."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ArtifactError

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
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in a file's place does not block the open
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


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: Path) -> str | None:
    """None when `path` is a regular file (or a link to one), else what it is
    instead, for a message (`is a FIFO, not a regular file`): found by its
    status alone, never opened (opening a FIFO blocks, /dev/zero never ends)."""
    try:
        found = path.stat()
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file where a folder on its path should be
        return "is a link to nothing" if path.is_symlink() else "is missing"
    except OSError as exc:  # a link loop, no permission to look
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(found.st_mode):
        return None
    kind = next((name for test, name in _KINDS if test(found.st_mode)), "not a file")
    link = f"a link to {os.path.realpath(path)}, " if path.is_symlink() else ""
    return f"is {link}{kind}, not a regular file"


def check_file(output_dir: Path, section: Mapping[str, Any], what: str) -> Path:
    """The path of a file the manifest lists, once its sha256 matches: a
    file in the output directory, never one a manifest points to elsewhere."""
    name = section["file"]
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ArtifactError(f"{output_dir}: the manifest names {name!r} for {what}, which is not a file in it")
    path = output_dir / name
    problem = not_a_file(path)
    if problem is not None:
        raise ArtifactError(f"{path} ({what}) {problem}; refusing to load it")
    digest = altered_digest(path, section)
    if digest is not None:
        raise ArtifactError(
            f"{path} ({what}) was altered after its build: sha256 {digest} differs from the manifest's "
            f"{section['sha256']}; refusing to load it"
        )
    return path


def check_served_files(output_dir: Path, manifest: Mapping[str, Any]) -> list[Path]:
    """The files copied beside the package (`module.files`: a tokenizer,
    generation_config.json), each once its sha256 matches the manifest's: an
    edited tokenizer.json changes the prompt's ids and the text silently."""
    return [
        check_file(output_dir, record, "a file served beside the package") for record in manifest.get("files") or []
    ]
