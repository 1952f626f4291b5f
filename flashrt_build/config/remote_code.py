"""A checkpoint directory's own code (its config.json `auto_map`): run by
transformers only with `trust_remote_code`, which an allow-list refuses, and
under an allow-list the directory itself refused before any of it is read."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .files import config_strings


def remote_code_problems(model: Any, patterns: list[str], key: str = "module.model") -> list[ConfigError]:
    """Under an allow-list, `trust_remote_code: true` at any depth: it runs
    code from the model's directory (its config.json `auto_map`), which no
    pattern can judge."""
    if not patterns:
        return []
    found = []
    if isinstance(model, Mapping):
        for k, v in model.items():
            if k == "trust_remote_code" and v:
                found.append(
                    ConfigError(
                        f"{key}.{k}",
                        v,
                        "runs code from the model's own directory, which an allow-list cannot judge: a release "
                        "build (or allowed_targets) refuses it",
                    )
                )
            else:
                found += remote_code_problems(v, patterns, f"{key}.{k}")
    elif isinstance(model, list):
        for i, v in enumerate(model):
            found += remote_code_problems(v, patterns, f"{key}.{i}")
    return found


def auto_map_problems(model: Any, cwd: Path, patterns: list[str], named: Mapping[str, str]) -> list[ConfigError]:
    """Under an allow-list, a save_pretrained directory named under
    `module.model` whose config.json maps the model to code of its own
    (`auto_map`): refused before any of it is read, unless the list names each
    class it maps to. (Even then its code is not run: `trust_remote_code` is
    refused under an allow-list, so transformers' own class is built.)"""
    if not patterns:
        return []
    found = []
    for key, value in config_strings(model, "module.model"):
        auto_map = _auto_map(cwd / value)
        refused = [ref for ref in auto_map if not any(fnmatch.fnmatchcase(ref, p) for p in patterns)]
        if refused:
            found.append(
                ConfigError(
                    named.get(value, key),
                    value,
                    f"holds a config.json whose auto_map maps the model to code of its own ({', '.join(refused)}); "
                    "a release build (or allowed_targets) reads none of a checkpoint's code: use a directory "
                    "without auto_map, or name those classes in allowed_targets to build transformers' own class",
                )
            )
    return found


def _auto_map(directory: Path) -> list[str]:
    """The class references of a directory's config.json `auto_map` (`modeling_x.XForCausalLM`,
    a hub repo's `repo--modeling_x.X`); none where there is no such file or map."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return []
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict):
        return []
    refs = [ref for v in auto_map.values() for ref in (v if isinstance(v, list) else [v]) if isinstance(ref, str)]
    return list(dict.fromkeys(refs))
