"""What a load relies on, recorded by the build inside the package (whose
digest the manifest records), so that an edited manifest is refused: its
target and GPU, the weights' mode, names, shapes, dtypes and layouts, the
state, every method's inputs (ranges included) and outputs. Digests of weight
values stay out: an external-weights package serves any checkpoint of its shapes."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from ..artifact import MANIFEST, SCHEMA
from ..errors import ArtifactError
from .manifest import manifest_methods

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
    if state and state.get("mode") == "in_place":  # only then: the contracts of earlier packages stay as they were
        contract["state_mode"] = "in_place"
    return json.loads(json.dumps(contract))  # as it reads back: JSON types only


def read_contract(package: Path) -> dict[str, Any] | None:
    """The contract a package was built with, or None for a package built before they were recorded."""
    try:
        with zipfile.ZipFile(package) as archive:
            member = next((n for n in archive.namelist() if n.partition("/")[2] == CONTRACT_MEMBER), None)
            return None if member is None else json.loads(archive.read(member))
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{package} is not an AOTInductor package: not a readable zip archive ({exc})") from None


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
