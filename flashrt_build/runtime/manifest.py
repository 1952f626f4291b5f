"""The manifest: what was built, from what, with what, and how it verified.

Written last into the staging directory: its presence means a build is complete.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import ArtifactError

SCHEMA = "flashrt_build.manifest/1"
MANIFEST = "manifest.json"
PACKAGE = "model.pt2"
SIDECAR = "weights.safetensors"
STATE = "state.safetensors"  # initial values of buffers a stateful module mutates
# The keyword argument that carries a stateful module's mutated buffers into and
# out of its package (the package's calling convention).
STATE_KWARG = "flashrt_state"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
