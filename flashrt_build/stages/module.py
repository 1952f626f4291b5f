"""Instantiate the module, load its checkpoint strictly, cast it;
and what the module is, for the manifest."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ..config.problems import raise_all
from ..config.spec import BuildSpec
from ..config.targets import distribution_of
from ..errors import ConfigError, InstantiateError, first_lines
from ..runtime.checkpoint import FROM_PRETRAINED, check_loading_report, loading_pretrained
from ..runtime.hashing import file_sha256
from .checkpoint import load_checkpoint
from .inputs import torch_dtype
from .objects import GIVEN, object_record
from .preflight import locate_target, real_name, source_file
from .progress import Stage

log = logging.getLogger(__name__)


def instantiate_stage(spec: BuildSpec, digests: Mapping[str, str]) -> Stage[torch.nn.Module]:
    """The module, its parameter count, and the manifest's `module` section."""
    module = instantiate_module(spec)
    note = f"{sum(p.numel() for p in module.parameters()):,} parameters"
    return Stage(module, note, {"module": provenance(spec, digests)})


def instantiate_module(spec: BuildSpec) -> torch.nn.Module:
    """Build the `nn.Module`, seeded, in eval mode, on the target device and dtype."""
    torch.manual_seed(spec.seed)  # its targets were located and allowed by the preflight
    pretrained = _is_from_pretrained(spec.target)
    loading = {k: v for k, v in FROM_PRETRAINED.items() if k not in spec.model} if pretrained else {}
    try:
        with loading_pretrained(*_pretrained_path(spec.model)) if pretrained else contextlib.nullcontext():
            module = instantiate(dict(spec.model), _convert_="all", **loading)
        if pretrained:
            module, report = module
            _check_loading_report(spec, report)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):  # the module's own check of its config (causal_lm's weights)
            raise cause from None
        raise_all(_unknown_arguments(spec, cause))
        raise InstantiateError(
            f"constructing {spec.target} raised {type(cause).__name__}: {first_lines(cause)}"
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise ConfigError("module.model._target_", spec.target, f"expected an nn.Module, got {type(module).__name__}")
    for method in spec.methods:
        if not callable(getattr(module, method.attr, None)):
            raise ConfigError(f"{method.key}.method", method.attr, f"{type(module).__name__} has no such method")
    if spec.checkpoint is not None:
        load_checkpoint(module, spec.checkpoint, spec.checkpoint_rename)
    module.eval()
    module.to(device=spec.device, dtype=torch_dtype(spec.dtype))
    return module


def _unknown_arguments(spec: BuildSpec, cause: BaseException) -> list[ConfigError]:
    """`widht: 8` under module.model, for a constructor that takes `width`:
    each key it does not take, with the closest parameter, where the
    TypeError names only the first and no key."""
    if not isinstance(cause, TypeError) or "unexpected keyword argument" not in str(cause):
        return []
    try:
        parameters = inspect.signature(locate_target(spec.target)).parameters
    except (TypeError, ValueError):  # a builtin that does not say
        return []
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return []  # it takes any: raised deeper, by something it called
    takes = [name for name, p in parameters.items() if p.kind is not p.VAR_POSITIONAL]
    problems = []
    for key in [k for k in spec.model if not str(k).startswith("_") and k not in parameters]:
        close = difflib.get_close_matches(str(key), takes, n=1)
        hint = f"did you mean {close[0]}?" if close else f"it takes {', '.join(takes) or 'none'}"
        problems.append(
            ConfigError(f"module.model.{key}", spec.model[key], f"{spec.target} takes no such argument; {hint}")
        )
    return problems


def _is_from_pretrained(target: str) -> bool:
    """A transformers `from_pretrained` (of a model class or an Auto class):
    it reports which of the directory's tensors it loaded."""
    name = real_name(locate_target(target)) or ""
    return name.endswith(".from_pretrained") and name.startswith("transformers.")


def _check_loading_report(spec: BuildSpec, report: Mapping[str, Any]) -> None:
    check_loading_report(report, *_pretrained_path(spec.model))


def _pretrained_path(model: Mapping[str, Any]) -> tuple[str, Any]:
    if "pretrained_model_name_or_path" in model:
        return "module.model.pretrained_model_name_or_path", model["pretrained_model_name_or_path"]
    args = model.get("_args_") or [None]
    return "module.model._args_.0", args[0]


def provenance(spec: BuildSpec, digests: Mapping[str, str]) -> dict[str, Any]:
    """The target's dotted path, what it really is, its source file digest and
    distribution; the checkpoint it was loaded from, file by file."""
    obj = locate_target(spec.target)
    source = source_file(obj)
    found = distribution_of(spec.target.split(".")[0])
    checkpoint = None
    if spec.checkpoint is not None:
        files = [f for f in spec.input_files if f.key == "module.checkpoint"]
        checkpoint = {
            "path": str(spec.checkpoint.path),
            # a lone file's digest; a directory's files are listed one by one
            "sha256": digests[files[0].label] if not spec.checkpoint.path.is_dir() else None,
            "format": spec.checkpoint.format,
            "files": [{"file": f.name, "sha256": digests[f.label]} for f in files],
            "rename": [{"pattern": p, "replace": r} for p, r in spec.checkpoint_rename],
        }
    return {
        "target": spec.target,
        "model_config": model_config(spec),
        "callable": real_name(obj),  # what the target really is: a class method by its class
        "source_file": source,
        "source_sha256": file_sha256(Path(source)) if source else None,
        "distribution": {"name": found[0], "version": found[1]} if found else None,
        "checkpoint": checkpoint,
        "seed": spec.seed,
        **({"object": object_record(spec.model["digest"])} if spec.target == GIVEN else {}),
    }


def model_config(spec: BuildSpec) -> dict[str, Any] | None:
    """The config.json of the save_pretrained directory the module was built
    from (`module.pretrained`, a from_pretrained path), as it was: the
    package is that architecture, and another checkpoint given at load
    must be one of it (runtime/checkpoint.py `config_differences`)."""
    found = next((f for f in spec.input_files if f.key.startswith("module.model.") and f.name == "config.json"), None)
    if found is None:
        return None
    try:
        config = json.loads(found.path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
