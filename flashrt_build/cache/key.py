"""The build key: a hash of everything that determines an artifact's bytes.

Computed without importing torch (or the module's code), so that deciding a
build is up to date costs a fraction of a build. Ingredients:

- config: what of the config shapes the artifact, read from the spec's typed
  fields (`keyed_config`); where it goes and how it is checked are left out
  (`NOT_KEYED` says why for each such key)
- module: the target's own source files (code you wrote: every .py file of its
  top-level package), or the installed distribution's name and version
- weights: the sha256 of each checkpoint file (every shard) and of each
  weight file the module's config names (a `from_pretrained` directory's
  shards), the renames that map its names, and the seed that initialises
  random weights
- model_files: the other files the module's config names (its `config.json`),
  which shape the graph
- toolchain: torch, Python, the C++ compiler and its version, CUDA, the CPU
  ISA, the GPU's architecture: the key fields of the one description
  (config/toolchain.py) the manifest records whole
- flashrt_build: this tool's own source

`graph_key` leaves out the weights: external-weights packages with the same
graph key are the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config.keys import value_at
from ..config.schema import PASS_SWITCHES
from ..config.spec import BuildSpec
from ..config.targets import source_tree_sha256
from ..config.toolchain import KEY_FIELDS
from ..runtime.hashing import canonical_sha256
from .digests import DigestCache
from .store import Store

# The config keys the key leaves out, each with why; every other key of the
# schema reaches `keyed_config` through the spec (tests/cache/test_key.py
# checks the schema against this and `keyed_config` key by key).
NOT_KEYED = {
    "output_root": "where the build goes",
    "output_dir": "where the build goes",
    "variant": "where the build goes",
    "force": "whether to build, not what",
    "threads": "how fast it builds",
    "python_path": "where the module's code is found; the code itself is the `module` ingredient",
    "verify": "how the package is checked before publishing, not what it is",
    "allowed_targets": "a check the config passes before anything runs",
    "seed": "keys the weights (the `weights` ingredient): random initialisation",
    "module.checkpoint": "keyed by its files' digests (the `weights` ingredient), not where it is",
    "module.checkpoint_rename": "which checkpoint tensor fills which weight: the `weights` ingredient, not the graph's",
    "module.files": "keyed by their digests (the `weights` ingredient), not where they are",
    "module.pretrained": "reaches the graph through `module.model` and `module.methods` it is interpolated into",
    "module.max_cache_len": "reaches the graph through `module.model` and `module.methods`",
    "module.max_prompt": "reaches the graph through `module.methods`",
    "module.batch": "reaches the graph through `module.model` and `module.methods`",
    "module.name": "names the artifact (the build key's `label`), not its graph: one compile for the same model",
    "target.name": "a label: the device, dtype and TF32 policy it sets are keyed",
    "passes.name": "a label: the switches it sets are keyed, each as it applied (a pass that rewrote nothing as off)",
    "inductor.name": "a label: the options it sets are keyed",
    "target.march": "reaches the graph as `inductor.options.cpp.march` where it applies (a CPU target)",
    "toolchain.cxx": "reaches the graph as `inductor.options.cpp.cxx`; its version is the `toolchain` ingredient",
    "quant.devices": "a check the config passes before anything runs",
    "quant.min_capability": "a check the config passes before anything runs",
    "quant.inductor": "reaches the graph merged into the Inductor options (`inductor.options`, `inductor.methods`)",
    "quant.rtol": "how the package is checked before publishing (the least `verify.rtol`), not what it is",
    "quant.max_rel_error": "judges the package, not its bytes: the build key's `judged`, not the graph's",
    "serve.cuda_graphs": "the loader's default: the build key's `serve`, not the graph's",
    "serve.max_graphs": "the loader's default: the build key's `serve`, not the graph's",
}
# Ingredients of the build key that leave the compiled graph as it is: the
# weights, the loader's defaults, the bounds the package is judged by.
BUILD_ONLY = ("weights", "serve", "judged", "label")


def input_digests(spec: BuildSpec, digests: DigestCache | None = None) -> dict[str, str]:
    """sha256 of every file the build reads, by label (`module.checkpoint/model-00001-of-00003.safetensors`);
    remembered in the store by stat, so an unchanged file is not read again."""
    digests = digests or DigestCache(Store(spec.output_root).root)
    found = dict(
        zip((f.label for f in spec.input_files), digests.sha256_all(f.path for f in spec.input_files), strict=True)
    )
    digests.save()
    return found


def key_ingredients(
    spec: BuildSpec,
    source: Mapping[str, Any],
    toolchain: Mapping[str, Any],
    digests: Mapping[str, str],
    idle_passes: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Everything the artifact's bytes depend on: the config without cosmetic
    keys, the module's code (`source`), every file the build reads (`digests`,
    by label), the toolchain's key fields (of its one description) and this
    tool's source. `idle_passes`: switches on that rewrote nothing, keyed as off."""
    config = keyed_config(spec, idle_passes)
    own_sha, _ = source_tree_sha256(str(Path(__file__).resolve().parents[1]))  # all of flashrt_build
    kinds = {f.label: f.kind for f in spec.input_files}
    ingredients = {
        "config": config,
        "module": dict(source),
        # files the module's config names that shape the graph (a from_pretrained directory's config.json)
        "model_files": {label: sha for label, sha in digests.items() if kinds[label] == "model"},
        "toolchain": {
            **key_fields(dict(toolchain)),
            # torchao shapes a quantized build's graph and weights, nothing else's
            **({"torchao": toolchain.get("torchao")} if spec.quant is not None else {}),
        },
        "flashrt_build": own_sha,
        "weights": {
            "checkpoint": {f.name: digests[f.label] for f in spec.input_files if f.key == "module.checkpoint"} or None,
            "files": {label: sha for label, sha in digests.items() if kinds[label] == "weights"},
            "seed": spec.seed,
            "checkpoint_rename": [list(rule) for rule in spec.checkpoint_rename],
        },
        "serve": spec.serve_defaults,
        "label": {"name": spec.name},  # the manifest's name: the artifact's, not the compiled graph's
    }
    if spec.quant is not None:
        ingredients["judged"] = {"quant.max_rel_error": spec.quant.max_rel_error}
    # As the manifest will hold them: JSON types (axis keys as strings), so a
    # stored key compares equal to a recomputed one.
    return json.loads(json.dumps(ingredients, default=str))


def keyed_config(spec: BuildSpec, idle_passes: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What of the config shapes the artifact, from the spec's typed fields:
    the module's inputs as the package takes them (float inputs in the target
    dtype), Inductor's options as each compile gets them (the profile's, the
    recipe's and the target's merged), TF32 as the calls run under it, the
    passes as they applied: one that rewrote nothing (`idle_passes`, known once
    the build ran it) is the build without it, the same bytes and key."""
    # Any path the build reads is keyed by what it holds, not where it is (a model saved elsewhere).
    read = {str(value_at(spec.model, f.key.removeprefix("module.model."))) for f in spec.input_files
            if f.key.startswith("module.model.")}  # fmt: skip
    return {
        "module": {
            "model": _content_keyed(dict(spec.model), read),
            "methods": {
                m.name: {
                    "attr": m.attr,
                    "model": m.model,
                    "inputs": [i.to_json() for i in m.inputs],
                    "kwargs": dict(m.kwargs),
                }
                for m in spec.methods
            },
        },
        "target": {"device": spec.device, "dtype": spec.dtype, "tf32": spec.tf32},
        "inductor": {
            "options": dict(spec.inductor_options),
            "methods": {name: dict(options) for name, options in spec.method_inductor_options.items()},
        },
        "quant": None if spec.quant is None else spec.quant.to_json(),  # its name and rules
        "passes": {switch: getattr(spec, switch) and switch not in idle_passes for switch in PASS_SWITCHES},
        "weights": spec.weights.value,
        # Of the serving keys only the state's mode shapes the graph; the loader's
        # defaults are the build key's alone (toggling them never recompiles).
        "serve": {"state": spec.state_mode.value},
        "release": spec.release,
    }


def key_fields(toolchain: Mapping[str, Any]) -> dict[str, Any]:
    """What of a toolchain description the build key hashes: the GPU's
    architecture, not which card (a build on cuda:1 is the build on cuda:0)."""
    key = {field: toolchain[field] for field in KEY_FIELDS}
    gpu = toolchain["gpu"]
    key["gpu"] = {k: gpu[k] for k in ("name", "capability")} if gpu else None
    return key


def _content_keyed(node: Any, paths: set[str]) -> Any:
    """`node` with every string naming a path the build reads replaced by a marker."""
    if isinstance(node, str):
        return "<read: keyed by its digests>" if node in paths else node
    if isinstance(node, Mapping):
        return {k: _content_keyed(v, paths) for k, v in node.items()}
    if isinstance(node, list):
        return [_content_keyed(v, paths) for v in node]
    return node


def build_keys(ingredients: dict[str, Any]) -> dict[str, str]:
    graph_key = canonical_sha256({k: v for k, v in ingredients.items() if k not in BUILD_ONLY})
    build = {"graph": graph_key, "weights": ingredients["weights"]}
    for name in ("serve", "judged", "label"):  # absent from the keys of artifacts built before them
        if name in ingredients:
            build[name] = ingredients[name]
    return {"graph_key": graph_key, "build_key": canonical_sha256(build)}


def method_keys(ingredients: dict[str, Any]) -> dict[str, str]:
    """For a package of several methods, one key per method: everything its
    own compiled model depends on, so changing one method's inputs changes
    that method's key only. A baked model holds the weights, so its key
    includes them."""
    config = ingredients["config"]
    keys = {}
    for name, method in config["module"]["methods"].items():
        own = {k: v for k, v in ingredients.items() if k not in BUILD_ONLY}
        # Its compile's options, not the other methods': a profile that
        # changes only decode's options leaves prefill's key as it was.
        inductor = {**config["inductor"], "methods": {name: config["inductor"]["methods"].get(name)}}
        own["config"] = {**config, "module": {**config["module"], "methods": {name: method}}, "inductor": inductor}
        if config["weights"] == "baked":
            own["weights"] = ingredients["weights"]
        keys[name] = canonical_sha256({"method": name, **own})
    return keys


def changed_ingredients(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """Which ingredients differ, config keys one by one and input files by
    name (`weights (model-00002-of-00003.safetensors)`): what the log says changed."""
    if not old:
        return ["no earlier build key"]
    changed = []
    for name, value in new.items():
        if name == "config" and isinstance(old.get("config"), dict):
            keys = sorted(set(value) | set(old["config"]))
            changed += [f"config.{k}" for k in keys if value.get(k) != old["config"].get(k)]
        elif old.get(name) != value:
            files = _changed_files(name, old.get(name), value)
            changed.append(f"{name} ({', '.join(files)})" if files else name)
    return changed


def _changed_files(name: str, old: Any, new: Any) -> list[str]:
    """The input files whose digests differ between two builds' ingredient `name`."""
    if name == "model_files":
        before, after = old if isinstance(old, dict) else {}, new
    elif name == "weights":
        before, after = _weight_files(old), _weight_files(new)
    else:
        return []
    labels = sorted(set(before) | set(after))
    changed = [label.partition("/")[2] for label in labels if before.get(label) != after.get(label)]
    return list(dict.fromkeys(changed))  # relative to its key; a file two keys read, once


def _weight_files(weights: Any) -> dict[str, str]:
    if not isinstance(weights, dict):
        return {}
    checkpoint = weights.get("checkpoint")
    if not isinstance(checkpoint, dict):
        checkpoint = {}
    return {f"module.checkpoint/{k}": v for k, v in checkpoint.items()} | dict(weights.get("files") or {})
