"""The manifest, assembled in one place from the sections the stages
returned, in the order of its schema (runtime/manifest.schema.json): a draft
the verification loads the package against, then the record, with how the
verification went and every stage's time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import __version__
from ..artifact import SCHEMA
from ..config.spec import BuildSpec
from ..runtime.hashing import config_sha256
from ..runtime.manifest import Manifest

UNVERIFIED = {"enabled": False, "passed": None}


def assemble_manifest(
    spec: BuildSpec,
    sections: Mapping[str, Any],
    *,
    options: Mapping[str, Any],
    keys: Mapping[str, str],
    ingredients: Mapping[str, Any],
    digests: Mapping[str, str],
    timings: dict[str, float],
) -> Manifest:
    """The manifest of a build: `sections` are the stages' (module, package,
    weights, state, inputs, outputs, methods, target, toolchain, and
    verification once it ran); the rest is the plan's."""
    return {
        "schema": SCHEMA,
        "name": spec.name,
        "flashrt_build": __version__,
        "module": sections["module"],
        # every file the build read (the checkpoint's shards, a from_pretrained directory): inputs of its key
        "build_inputs": [
            {
                "key": f.key,
                "file": f.name,
                "path": str(f.path),
                "bytes": f.path.stat().st_size,
                "sha256": digests[f.label],
                "kind": f.kind,
            }  # fmt: skip
            for f in spec.input_files
        ],
        "package": sections["package"],
        "weights": sections["weights"],
        "state": sections["state"],
        # shared libraries of the custom operators the package calls: loaded before it
        **({"libraries": sections["libraries"]} if sections.get("libraries") else {}),
        # mixture-of-experts models switched to an experts path a package can run (experts.py)
        **({"experts": sections["experts"]} if sections.get("experts") else {}),
        **({"files": sections["files"]} if sections.get("files") else {}),  # copied beside the package
        "inputs": sections["inputs"],
        "outputs": sections["outputs"],
        "methods": sections["methods"],
        "target": sections["target"],
        "serve": spec.serve_defaults,
        "toolchain": sections["toolchain"],
        "inductor": {"options": _jsonable(options)},
        **({"quant": sections["quant"]} if "quant" in sections else {}),
        **({"passes": passes_record(sections)} if "passes" in sections else {}),
        "release": spec.release,
        "config": dict(spec.config),
        "config_sha256": config_sha256(spec.config),
        "graph_key": keys["graph_key"],
        "build_key": keys["build_key"],
        "key_ingredients": dict(ingredients),
        "verification": sections.get("verification", UNVERIFIED),
        "timings": timings,  # the timer's own record: it still grows by the manifest stage after the write
    }


def finish_manifest(draft: Manifest, verification: Mapping[str, Any] | None, timings: dict[str, float]) -> Manifest:
    """The record of a build: its draft, with how verification went (none ran:
    unverified) and the stages' times (the timer's own dict: it still grows by
    the manifest stage, after the write)."""
    record: Manifest = {**draft}
    record["verification"] = dict(verification) if verification is not None else UNVERIFIED
    record["timings"] = timings
    return record


def passes_record(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The passes stage's record, with what the export stage's rewrites (gemv_fusion, rotary_fusion,
    decode_attention's shared masks) did: their one record, a pass's two parts in one."""
    passes, rewrites = sections["passes"], sections.get("rewrites", {})
    return {**passes, **{name: {**passes.get(name, {}), **did} for name, did in rewrites.items()}}


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v))
        for k, v in options.items()
    }
