"""The `module` group resolved: its name, every `_target_` held against the
allow-list (as written: nothing is imported), its entry points, its
checkpoint and renames, the files served beside its package, and where its
code imports from."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..runtime.formats import Checkpoint, resolve_checkpoint
from .files import InputFile, checkpoint_files, served_files
from .inputs import NAME_RULE, MethodSpec, is_name, resolve_methods
from .problems import Problems
from .remote_code import remote_code_problems
from .targets import allow_list_refusal, allowed_targets, find_targets, target_allowed


@dataclass(frozen=True)
class ModuleSpec:
    """What to build, before its target and options."""

    name: str
    model: Mapping[str, Any]  # the node given to hydra.utils.instantiate
    target: str  # its `_target_`
    methods: list[MethodSpec]
    checkpoint: Checkpoint | None
    checkpoint_rename: tuple[tuple[str, str], ...]  # (pattern, replacement), first match wins
    files: list[InputFile]  # the checkpoint's and the served files: inputs of the key
    import_paths: tuple[Path, ...]  # python_path's directories, then the working directory
    allowed_targets: tuple[str, ...]  # the effective allow-list (the release profile's included); (): any


def resolve_module(config: dict[str, Any], cwd: Path, problems: Problems) -> ModuleSpec:
    """The `module` group (and `python_path`), every problem added to `problems`."""
    module = config["module"]
    record_absolute_paths(module, cwd)
    name = module["name"]
    if not is_name(name):
        problems.append(ConfigError("module.name", name, f"expected {NAME_RULE}"))
    model = module["model"]
    target = model.get("_target_") if isinstance(model, dict) else None
    if not isinstance(target, str) or not target:
        problems.append(ConfigError("module.model._target_", target, "expected a dotted import path"))
    allowed = allowed_targets(config)
    _check_targets(config, model, allowed, problems)
    if module.get("pretrained") is not None and not (isinstance(module.get("batch"), int) and module["batch"] >= 1):
        # causal_lm's: said as set, before the inputs' shapes it is interpolated into are
        raise ConfigError("module.batch", module.get("batch"), "expected the sequences decoded at once, at least 1")
    methods = resolve_methods(module, problems.check)
    given = module.get("checkpoint")
    checkpoint = None
    if given:
        checkpoint = problems.check(resolve_checkpoint, "module.checkpoint", given, cwd / Path(given).expanduser())
    rename = _resolve_renames(module.get("checkpoint_rename") or [], given, problems)
    files = checkpoint_files(checkpoint) if checkpoint is not None else []
    files += problems.check(served_files, "module.files", module.get("files") or [], cwd) or []
    import_paths = _import_paths(config.get("python_path") or [], cwd, problems)
    config["python_path"] = [str(path) for path in import_paths]  # recorded: repro imports from there too
    return ModuleSpec(name, model, str(target), methods, checkpoint, rename, files, import_paths, tuple(allowed))


def record_absolute_paths(module: dict[str, Any], cwd: Path) -> None:
    """`module.pretrained` and `module.files` as absolute paths, wherever the
    resolved config holds them (interpolated into `module.model` too): the
    manifest records them so, and `repro` rebuilds from any directory. Their
    contents, not where they are, key the build."""
    pretrained = module.get("pretrained")
    if isinstance(pretrained, str) and pretrained.strip():
        absolute = os.path.abspath(cwd / Path(pretrained).expanduser())
        module["pretrained"] = absolute
        module["model"] = _replaced(module["model"], pretrained, absolute)
    files = module.get("files") or []
    module["files"] = [os.path.abspath(cwd / Path(f).expanduser()) if isinstance(f, str) else f for f in files]


def _replaced(node: Any, old: str, new: str) -> Any:
    if isinstance(node, str):
        return new if node == old else node
    if isinstance(node, dict):
        return {k: v if k == "_target_" else _replaced(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_replaced(v, old, new) for v in node]
    return node


def _check_targets(config: Mapping[str, Any], model: Any, allowed: list[str], problems: Problems) -> None:
    """Every `_target_` at any depth: a dotted path, on the allow-list (`allowed`) as written."""
    for key, value in find_targets(model, "module.model"):
        if not isinstance(value, str) or not value:
            if key != "module.model._target_":  # the module's own is reported by resolve_module
                problems.append(ConfigError(key, value, "expected a dotted import path"))
        elif allowed and not target_allowed(value, allowed):
            problems.append(ConfigError(key, value, allow_list_refusal(value, config)))
    problems += remote_code_problems(model, allowed)


def _resolve_renames(
    rules: list[Mapping[str, Any]], checkpoint: str | None, problems: Problems
) -> tuple[tuple[str, str], ...]:
    """`module.checkpoint_rename` as (pattern, replacement) pairs, each pattern a valid regex."""
    if rules and not checkpoint:
        problems.append(
            ConfigError("module.checkpoint_rename", rules, "renames the names of a checkpoint: set module.checkpoint")
        )
    for i, rule in enumerate(rules):
        try:
            re.compile(rule["pattern"])
        except re.error as exc:
            problems.append(
                ConfigError(
                    f"module.checkpoint_rename.{i}.pattern", rule["pattern"], f"not a regular expression ({exc})"
                )
            )
    return tuple((rule["pattern"], rule.get("replace") or "") for rule in rules)


def _import_paths(given: list[str], cwd: Path, problems: Problems) -> tuple[Path, ...]:
    """`python_path`'s directories, resolved, then the working directory."""
    paths = []
    for i, entry in enumerate(given):
        path = (cwd / Path(entry).expanduser()).resolve()
        if not path.is_dir():
            problems.append(ConfigError(f"python_path.{i}", entry, "no such directory to import from"))
        paths.append(path)
    return tuple(dict.fromkeys([*paths, cwd.resolve()]))
