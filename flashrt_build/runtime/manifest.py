"""The manifest: what was built, from what, with what, and how it verified.

Written last into the staging directory: its presence means a build is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
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
    """Parse and check a manifest; a missing, broken, foreign or malformed one is refused."""
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
    check_manifest(manifest, path)
    return manifest


class _Malformed(Exception):
    pass


def check_manifest(manifest: dict[str, Any], path: Path | str = MANIFEST) -> None:
    """Every field a load relies on is there with the type it relies on: a
    manifest that says otherwise cannot be trusted (a hand edit, a truncated
    copy) and is refused naming the field, instead of a package being bound
    and called against it. What a load relies on is also recorded inside the
    package at build time (`check_contract`), so a well-formed edit is caught too."""
    try:
        _check_fields(manifest)
    except _Malformed as exc:
        raise ArtifactError(f"{path}: {exc}; the manifest cannot be trusted, refusing it") from None


def _need(node: Any, field: str, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """`node[field]`, which must be of `kind` (None allowed when `optional`)."""
    if not isinstance(node, dict):
        raise _Malformed(f"{key or 'the manifest'} is not an object")
    full = f"{key}.{field}" if key else field
    if field not in node:
        if optional:
            return None
        raise _Malformed(f"{full} is missing")
    value = node[field]
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _Malformed(f"{full} is {json.dumps(value)[:60]}, expected {' or '.join(k.__name__ for k in kinds)}")
    return value


def _ints(value: Any, key: str, least: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise _Malformed(f"{key} is {json.dumps(value)[:60]}, expected a list of integers")
    if any(n < least for n in value):
        raise _Malformed(f"{key} is {value}, expected integers >= {least}")
    return value


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Malformed(f"{key} is {json.dumps(value)[:60]}, expected a list of strings")
    return value


_HEX64 = frozenset("0123456789abcdef")


def _file(node: Any, key: str) -> None:
    name = _need(node, "file", key, str)
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise _Malformed(f"{key}.file is {name!r}, expected a file name inside the output directory")
    for field in ("sha256",):
        digest = _need(node, field, key, str)
        if len(digest) != 64 or not set(digest) <= _HEX64:
            raise _Malformed(f"{key}.{field} is {digest!r}, expected 64 hex digits")
    if _need(node, "bytes", key, int, optional=True) is not None and node["bytes"] < 0:
        raise _Malformed(f"{key}.bytes is {node['bytes']}, expected a size >= 0")
    if _need(node, "chunk_bytes", key, int, optional=True) is not None and node["chunk_bytes"] <= 0:
        raise _Malformed(f"{key}.chunk_bytes is {node['chunk_bytes']}, expected a size > 0")
    _strings(node.get("chunk_sha256", []), f"{key}.chunk_sha256")


def _tensor(entry: Any, key: str, full: bool = True) -> None:
    _need(entry, "fqn", key, str)
    shape = _ints(_need(entry, "shape", key, list), f"{key}.shape", 0)
    _need(entry, "dtype", key, str)
    if not full:
        return
    if _need(entry, "kind", key, str) not in ("parameter", "buffer", "constant"):
        raise _Malformed(f"{key}.kind is {entry['kind']!r}, expected parameter, buffer or constant")
    stride = _need(entry, "stride", key, list, optional=True)
    if stride is not None and len(_ints(stride, f"{key}.stride", 0)) != len(shape):
        raise _Malformed(f"{key}.stride is {stride}, expected one stride per axis of shape {shape}")
    _need(entry, "persistent", key, bool, optional=True)
    _need(entry, "source", key, str, optional=True)
    _strings(entry.get("aliases", []), f"{key}.aliases")
    methods = _need(entry, "methods", key, dict, optional=True) or {}
    if not all(isinstance(v, str) for v in methods.values()):
        raise _Malformed(f"{key}.methods must map method names to the names they bind")


def _inputs(value: Any, key: str) -> None:
    if not isinstance(value, list):
        raise _Malformed(f"{key} is not a list")
    for i, spec in enumerate(value):
        at = f"{key}[{i}]"
        _need(spec, "name", at, str)
        shape = _ints(_need(spec, "shape", at, list), f"{at}.shape", 1)
        _need(spec, "dtype", at, str)
        _need(spec, "positional", at, bool)
        for axis, dim in _need(spec, "dynamic", at, dict).items():
            where = f"{at}.dynamic.{axis}"
            if not axis.isdigit() or int(axis) >= len(shape):
                raise _Malformed(f"{where} is not an axis of shape {shape}")
            _need(dim, "name", where, str)
            low, high = _need(dim, "min", where, int), _need(dim, "max", where, int)
            if not 1 <= low <= high:
                raise _Malformed(f"{where} is [{low}, {high}], expected 1 <= min <= max")
        low, high = _need(spec, "low", at, int, optional=True), _need(spec, "high", at, int, optional=True)
        if low is not None and high is not None and high <= low:
            raise _Malformed(f"{at} has high {high} <= low {low}")


def _outputs(value: Any, key: str) -> None:
    if not isinstance(value, list):
        raise _Malformed(f"{key} is not a list")
    for i, out in enumerate(value):
        _need(out, "dtype", f"{key}[{i}]", str)
        if _need(out, "shape", f"{key}[{i}]", list, optional=True) is not None:
            shape = out["shape"]
            if not all(isinstance(n, (int, str)) and not isinstance(n, bool) for n in shape):
                raise _Malformed(f"{key}[{i}].shape is {shape}, expected sizes and dim names")


def _check_fields(m: dict[str, Any]) -> None:
    _need(m, "name", "", str)
    _need(m, "release", "", bool, optional=True)
    target = _need(m, "target", "", dict)
    device = _need(target, "device", "target", str)
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise _Malformed(f"target.device is {device!r}, expected cpu, cuda or cuda:N")
    _need(target, "dtype", "target", str)
    _need(target, "tf32", "target", bool, optional=True)
    _file(_need(m, "package", "", dict), "package")
    weights = _need(m, "weights", "", dict)
    mode = _need(weights, "mode", "weights", str)
    if mode not in ("baked", "external"):
        raise _Malformed(f"weights.mode is {mode!r}, expected baked or external")
    if mode == "external":
        _file(weights, "weights")
    for i, entry in enumerate(_need(weights, "tensors", "weights", list)):
        _tensor(entry, f"weights.tensors[{i}]")
    _strings(weights.get("unused", []), "weights.unused")
    state = _need(m, "state", "", dict, optional=True)
    if state is not None:
        _file(state, "state")
        for i, entry in enumerate(_need(state, "tensors", "state", list)):
            _tensor(entry, f"state.tensors[{i}]", full=False)
    _inputs(_need(m, "inputs", "", list), "inputs")
    _outputs(_need(m, "outputs", "", list), "outputs")
    for name, entry in (_need(m, "methods", "", dict, optional=True) or {}).items():
        at = f"methods.{name}"
        _need(entry, "method", at, str)
        _need(entry, "model", at, str)
        _inputs(_need(entry, "inputs", at, list), f"{at}.inputs")
        _outputs(_need(entry, "outputs", at, list), f"{at}.outputs")
        _need(entry, "kwargs", at, dict)
        _strings(_need(entry, "state", at, list), f"{at}.state")
    gpu = _need(_need(m, "toolchain", "", dict), "gpu", "toolchain", dict, optional=True)
    if gpu is not None:
        _need(gpu, "name", "toolchain.gpu", str)
        _need(gpu, "capability", "toolchain.gpu", str)
    _need(_need(m, "config", "", dict), "module", "config", dict)


# Inside the package's archive: what a load relies on, as the build wrote it.
CONTRACT_MEMBER = "extra/flashrt_build/contract.json"


def load_contract(manifest: dict[str, Any]) -> dict[str, Any]:
    """What loading and calling a package relies on, from its manifest: the
    target and GPU, the weights' mode, names, shapes, dtypes and layouts, the
    state, the inputs (ranges included) and outputs of each method. The build
    writes it into the package, whose digest the manifest records, so an edit
    of any of it in manifest.json is detected. Digests of weight values are
    left out: an external-weights package serves any checkpoint of its shapes."""
    weights, state = manifest["weights"], manifest.get("state")
    gpu = manifest["toolchain"].get("gpu")
    contract = {
        "schema": SCHEMA,
        "target": {key: manifest["target"].get(key) for key in ("device", "dtype", "tf32")},
        "gpu": {key: gpu.get(key) for key in ("name", "capability")} if gpu else None,
        "weights": {
            "mode": weights["mode"],
            "tensors": [{k: v for k, v in entry.items() if k != "sha256"} for entry in weights["tensors"]],
            "unused": weights.get("unused", []),
        },
        "state": [{k: t[k] for k in ("fqn", "shape", "dtype")} for t in state["tensors"]] if state else None,
        "inputs": manifest["inputs"],
        "outputs": manifest["outputs"],
        "methods": {
            name: {k: entry.get(k) for k in ("method", "model", "inputs", "outputs", "kwargs", "state")}
            for name, entry in manifest_methods(manifest).items()
        },
    }
    return json.loads(json.dumps(contract))  # as it reads back: JSON types only


def read_contract(package: Path) -> dict[str, Any] | None:
    """The contract a package was built with, or None for a package built before they were recorded."""
    with zipfile.ZipFile(package) as archive:
        member = next((n for n in archive.namelist() if n.partition("/")[2] == CONTRACT_MEMBER), None)
        return None if member is None else json.loads(archive.read(member))


def check_contract(package: Path, manifest: dict[str, Any], path: Path | str = MANIFEST) -> None:
    """Refuse a manifest whose load-relevant fields differ from what the build
    recorded inside the package (whose own digest was checked first)."""
    recorded = read_contract(package)
    if recorded is None:
        return
    differences = _differences(load_contract(manifest), recorded)
    if differences:
        key, said, built = differences[0]
        more = f" (and {len(differences) - 1} more fields)" if len(differences) > 1 else ""
        raise ArtifactError(
            f"{path} was edited after its build: {key} is {json.dumps(said)[:80]} in it, "
            f"{json.dumps(built)[:80]} in the package's own record{more}; refusing to load it"
        )


_ABSENT = object()


def _differences(a: Any, b: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, a's value, b's value) wherever two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for k in sorted(set(a) | set(b)):
            found += _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{key}.{k}" if key else k)
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{key}[{i}]")]
    if a == b and type(a) is type(b):
        return []
    return [(key, None if a is _ABSENT else a, None if b is _ABSENT else b)]


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
