"""What a config may run, and where that code comes from: every `_target_`
is code that runs when the module is built. The allow-list
(`allowed_targets`, the release profile's zoo) is checked here on the path as
written, before anything is imported; the build checks it again on what the
located object really is (stages/preflight.py). Which source files or which
installed distribution a target comes from keys the build and is recorded."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

# What a release build may instantiate without the user widening
# allowed_targets: the shipped configs' own targets, each by name
# (tests/config/test_spec.py keeps this list equal to them).
RELEASE_TARGETS = (
    "flashrt_build.examples.MLP",
    "flashrt_build.examples.T5Seq2Seq",
    "flashrt_build.examples.TinyLM",
    "torchvision.models.resnet50",
    "transformers.BertConfig",
    "transformers.AutoModelForCausalLM.from_pretrained",
    "transformers.BertModel",
    "transformers.GPT2Config",
    "transformers.GPT2LMHeadModel",
    "transformers.LlamaConfig",
    "transformers.LlamaForCausalLM",
    "transformers.T5Config",
)


def allowed_targets(config: Mapping[str, Any]) -> list[str]:
    """The effective allow-list: the config's patterns, plus the zoo for a release."""
    patterns = list(config.get("allowed_targets") or [])
    if config.get("release"):
        patterns = [*RELEASE_TARGETS, *patterns]
    return patterns


def target_allowed(target: str, patterns: list[str], real_name: str | None = None) -> bool:
    """Is a `_target_` on the allow-list? Before import, by the path as written
    (`real_name` None). After Hydra located the object, also by what it really
    is, `module.qualname`, because Hydra follows attributes through modules:
    `transformers.modeling_utils.torch.save` is torch's `save`. A pattern that
    names the path exactly, without wildcards, admits it as written."""
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in patterns):
        return False
    if real_name is None or target in patterns:
        return True
    return any(fnmatch.fnmatchcase(real_name, pattern) for pattern in patterns)


def find_targets(node: Any, key: str) -> list[tuple[str, Any]]:
    """Every `_target_` in a config node at any depth (nested arguments,
    `_args_` lists, `_partial_` nodes), with its full key."""
    found = []
    if isinstance(node, Mapping):
        if "_target_" in node:
            found.append((f"{key}._target_", node["_target_"]))
        for k, v in node.items():
            if k != "_target_":
                found += find_targets(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += find_targets(v, f"{key}.{i}")
    return found


def _installed(path: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def module_source(target: str) -> dict[str, Any]:
    """What the target's code is: its source digest, or its distribution and version."""
    top = target.split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None or found.origin is None and not found.submodule_search_locations:
        return {"target": target, "unresolved": True}
    root = found.submodule_search_locations[0] if found.submodule_search_locations else found.origin
    dist = distribution_of(top) if _installed(root) else None
    if dist is not None:
        return {"target": target, "distribution": dist[0], "version": dist[1]}
    sha, count = source_tree_sha256(root)
    return {"target": target, "source_sha256": sha, "files": count}


def distribution_of(top: str) -> tuple[str, str] | None:
    """(name, version) of the installed distribution that provides the top-level
    package `top`. The distribution named like the package first: scanning
    every distribution's file list (`packages_distributions`) takes half a
    second beside CUDA torch's thousands of files, on every up-to-date check."""
    try:
        dist = metadata.distribution(top)
        provided = (dist.read_text("top_level.txt") or "").split() or [
            str(f).split("/")[0] for f in dist.files or [] if "/" in str(f)
        ]
        if top in provided:
            return dist.metadata["Name"], dist.version
    except metadata.PackageNotFoundError:
        pass
    names = metadata.packages_distributions().get(top, [])
    return (names[0], metadata.version(names[0])) if names else None


def source_tree_sha256(root: str) -> tuple[str, int]:
    """sha256 over a package's .py files (relative paths and contents) and their count."""
    digest = hashlib.sha256()
    base = Path(root)
    files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
    for path in files:
        digest.update(str(path.relative_to(base) if base.is_dir() else path.name).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest(), len(files)
