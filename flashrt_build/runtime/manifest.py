"""The manifest: what was built, from what, with what, and how it verified.

Written last into the staging directory: its presence means a build is
complete. Its schema is written once, `manifest.schema.json` (see schema.py);
the typed structures below name the fields the code reads and writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from ..artifact import MANIFEST, SCHEMA
from ..errors import ArtifactError
from .hashing import not_a_file
from .schema import schema_problems


class NoBuild(ArtifactError):
    """A directory without a manifest (a regular file of that name): no
    build at all, rather than a build altered (a wrong path, for a command)."""


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> Path:
    """Write `manifest.json`, refusing one that breaks the schema: every
    manifest a build writes is checked against what loads will check."""
    check_manifest(manifest, directory / MANIFEST)
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and check a manifest; a missing, broken, foreign or malformed one is refused."""
    path = Path(directory) / MANIFEST
    problem = not_a_file(path)  # a FIFO or /dev/zero in its place is never opened
    if problem is not None:
        said = "does not exist" if problem == "is missing" else problem
        raise NoBuild(f"{path} {said}: {directory} holds no complete build{_builds_near(Path(directory))}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path} has schema {found!r}, expected {SCHEMA!r}")
    check_manifest(manifest, path)
    return manifest


def _builds_near(path: Path) -> str:
    """What was likely meant: the build a file of it is in (`.../model.pt2`),
    or the builds one level below (`outputs/mlp` holds `cpu-baked-default`)."""
    try:
        if path.is_file() and (path.parent / MANIFEST).is_file():
            return f"; {path.name} is a file of the build at {path.parent}"
        below = sorted(d.name for d in path.iterdir() if (d / MANIFEST).is_file()) if path.is_dir() else []
    except OSError:  # unreadable: nothing to add
        return ""
    more = f" and {len(below) - 5} more" if len(below) > 5 else ""
    return f"; the builds in it: {', '.join(below[:5])}{more}" if below else ""


def check_manifest(manifest: Mapping[str, Any], path: Path | str = MANIFEST) -> None:
    """Every field a load relies on is there with the type it relies on: a
    manifest that says otherwise cannot be trusted (a hand edit, a truncated
    copy) and is refused naming the field, instead of a package being bound
    and called against it. What a load relies on is also recorded inside the
    package at build time (`contract.check_contract`), so a well-formed edit is caught too."""
    problems = schema_problems(manifest) or _inconsistencies(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ArtifactError(f"{path}: {problems[0]}{more}; the manifest cannot be trusted, refusing it")


def _inconsistencies(manifest: Mapping[str, Any]) -> list[str]:
    """What the schema cannot say: fields that must agree with each other."""
    found = []
    for i, entry in enumerate(manifest["weights"]["tensors"]):
        stride = entry.get("stride")
        if stride is not None and len(stride) != len(entry["shape"]):
            found.append(f"weights.tensors[{i}].stride is {stride}, expected one stride per axis of {entry['shape']}")
    entries = [("inputs", manifest["inputs"])]
    entries += [(f"methods.{name}.inputs", m["inputs"]) for name, m in (manifest.get("methods") or {}).items()]
    for key, inputs in entries:
        for i, spec in enumerate(inputs):
            at = f"{key}[{i}]"
            for axis, dim in spec["dynamic"].items():
                if int(axis) >= len(spec["shape"]):
                    found.append(f"{at}.dynamic.{axis} is not an axis of shape {spec['shape']}")
                elif dim["min"] > dim["max"]:
                    found.append(f"{at}.dynamic.{axis} is [{dim['min']}, {dim['max']}], expected min <= max")
            if spec.get("low") is not None and spec.get("high") is not None and spec["high"] <= spec["low"]:
                found.append(f"{at} has high {spec['high']} <= low {spec['low']}")
    return found


class FileRecord(TypedDict, total=False):
    file: str
    sha256: str
    bytes: int
    chunk_bytes: int
    chunk_sha256: list[str]


class InputEntry(TypedDict, total=False):
    name: str
    shape: list[int]
    dtype: str
    dynamic: dict[str, dict[str, Any]]
    positional: bool
    low: int | None
    high: int | None


class MethodEntry(TypedDict, total=False):
    method: str
    model: str
    inputs: list[InputEntry]
    outputs: list[dict[str, Any]]
    kwargs: dict[str, Any]
    state: list[str]
    inductor_options: dict[str, Any]
    compiled: str
    method_key: str


class Manifest(TypedDict, total=False):
    """manifest.json's top level (schema flashrt_build.manifest/1)."""

    schema: str
    name: str
    flashrt_build: str
    module: dict[str, Any]
    build_inputs: list[dict[str, Any]]
    package: FileRecord
    weights: dict[str, Any]
    state: dict[str, Any] | None
    libraries: list[dict[str, Any]]  # shared libraries of the custom operators the package calls
    experts: dict[str, Any]  # mixture-of-experts models switched to experts a package can run
    files: list[FileRecord]  # copied beside the package (a tokenizer)
    inputs: list[InputEntry]
    outputs: list[dict[str, Any]]
    methods: dict[str, MethodEntry]
    target: dict[str, Any]
    serve: dict[str, Any]
    inductor: dict[str, Any]
    quant: dict[str, Any]  # a quantized build: the recipe, torchao's version, each Linear's rule
    passes: dict[str, Any]  # graph passes applied: what each changed (fused tensors, their source rows)
    release: bool
    config: dict[str, Any]
    config_sha256: str
    graph_key: str
    build_key: str
    key_ingredients: dict[str, Any]
    toolchain: dict[str, Any]
    verification: dict[str, Any]
    timings: dict[str, float]
    from_store: str


def method_bindings(tensors: list[dict[str, Any]], method: str) -> dict[str, str]:
    """The names a method's model binds, each mapped to its entry in
    `weights.tensors` (and the sidecar). A package of several methods records
    per entry which methods bind it, and by which name."""
    return {
        (entry["methods"][method] if "methods" in entry else entry["fqn"]): entry["fqn"]
        for entry in tensors
        if "methods" not in entry or method in entry["methods"]
    }


def quantized_originals(tensors: list[Mapping[str, Any]]) -> list[str]:
    """The float weights a quantized package's parts came from (their FQNs,
    sorted): what a float checkpoint names in their place."""
    return sorted({t["quantized"]["from"] for t in tensors if t.get("quantized")})


def fused_tensors(manifest: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """A package's fused projections (`passes`): each fused tensor's name with
    the checkpoint tensors its rows are, in order, as (name, [start, end])."""
    fused = []
    for record in ((manifest.get("passes") or {}).get("fuse_projections") or {}).get("fused") or []:
        for kind in ("weight", "bias") if record.get("bias") else ("weight",):
            parts = [(part["name"].removesuffix(".weight") + f".{kind}", part["rows"]) for part in record["from"]]
            fused.append((record[kind], parts))
    return fused


def state_mode(manifest: dict[str, Any]) -> str | None:
    """How the package keeps its state: "in_place", "threaded" (also every
    stateful manifest written before the mode was recorded), None: no state."""
    state = manifest.get("state")
    return (state.get("mode") or "threaded") if state else None


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


# The keys of the shipped `causal_lm` config a user sets for a package's sizes
# (the manifest's `config.module`, `pretrained` set): its prompts and cache are refused in their words.
CAUSAL_LM_KEYS = ("pretrained", "max_cache_len", "max_prompt", "batch")
# What each of them bounds, for a message.
CAUSAL_LM_MEANING = {
    "module.batch": "the sequences it decodes at once",
    "module.max_prompt": "the longest prompt its prefill takes",
    "module.max_cache_len": "the positions its cache holds",
}


def causal_lm_module(manifest: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The `module` config of a `causal_lm` package (its sizes are keys a
    user sets); None for any other package (its inputs' own keys apply)."""
    module = ((manifest or {}).get("config") or {}).get("module") or {}
    if not isinstance(module, Mapping) or not all(key in module for key in CAUSAL_LM_KEYS):
        return None
    return module if module["pretrained"] else None  # only causal_lm's config names a directory


def causal_lm_sizes(manifest: Mapping[str, Any] | None, inputs: list[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """For a `causal_lm` package's method, the key a user sets that bounds
    each of its inputs' sizes and values, by (input, axis) and (input,
    "values"): the batch axis `module.batch`, the prompt's length
    `module.max_prompt`, the decode's position `module.max_cache_len` (as the
    shipped config derives them). Empty for any other package."""
    if causal_lm_module(manifest) is None:
        return {}
    sizes: dict[tuple[str, str], str] = {}
    for spec in inputs:
        if spec["shape"]:
            sizes[(spec["name"], "0")] = "module.batch"
        for axis, dim in spec["dynamic"].items():
            if dim.get("name") == "prompt":
                sizes[(spec["name"], axis)] = "module.max_prompt"
        if spec["name"] == "position" and spec.get("high") is not None:
            sizes[(spec["name"], "values")] = "module.max_cache_len"
    return sizes
