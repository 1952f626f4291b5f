"""Stage 2: instantiate the module, load its checkpoint strictly, cast it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from hydra._internal.utils import _locate
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ..config.spec import BuildSpec, allowed_targets, find_targets, target_allowed
from ..errors import ConfigError, InstantiateError, first_lines
from ..runtime.checkpoint import read_checkpoint
from .inputs import torch_dtype

log = logging.getLogger(__name__)


def locate_target(target: str, key: str = "module.model._target_") -> Any:
    """The object a dotted `_target_` names, found the way Hydra's instantiate
    finds it (modules, then attributes: a class method or a factory is a
    target too), or a ConfigError naming the key."""
    try:
        return _locate(target)
    except Exception as exc:
        cause = exc.__cause__ or exc
        why = f"{type(cause).__name__}: {first_lines(cause, 1)}"
        raise ConfigError(key, target, f"cannot be imported ({why})") from None


def real_name(obj: Any) -> str | None:
    """`module.qualname` of what a target really is (a bound class method by
    its function), or None for an object that does not say."""
    function = getattr(obj, "__func__", obj)
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def check_targets(spec: BuildSpec) -> None:
    """Every `_target_` of the module, at any depth, located and, when
    `allowed_targets` (or the release profile) restricts them, checked by what
    the object really is, before anything is instantiated."""
    patterns = allowed_targets(spec.config)
    for key, target in find_targets(spec.model, "module.model"):
        obj = locate_target(target, key)
        if not patterns:
            continue
        name = real_name(obj)
        if name is None and target not in patterns:
            what = f"is a {type(obj).__name__} that names no module"
            raise ConfigError(key, target, f"{what}; allowed_targets: {patterns}")
        if not target_allowed(target, patterns, name):
            raise ConfigError(key, target, f"is {name}, which allowed_targets does not admit: {patterns}")


def instantiate_module(spec: BuildSpec) -> torch.nn.Module:
    """Build the `nn.Module`, seeded, in eval mode, on the target device and dtype."""
    check_targets(spec)  # an unimportable or forbidden target is a config error, not a build error
    torch.manual_seed(spec.seed)
    try:
        module = instantiate(dict(spec.model), _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        raise InstantiateError(
            f"constructing {spec.target} raised {type(cause).__name__}: {first_lines(cause)}"
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise ConfigError("module.model._target_", spec.target, f"expected an nn.Module, got {type(module).__name__}")
    for method in spec.methods:
        if not callable(getattr(module, method.attr, None)):
            raise ConfigError(f"{method.key}.method", method.attr, f"{type(module).__name__} has no such method")
    if spec.checkpoint is not None:
        load_checkpoint(module, spec.checkpoint)
    module.eval()
    module.to(device=spec.device, dtype=torch_dtype(spec.dtype))
    return module


def load_checkpoint(module: torch.nn.Module, path: Path) -> None:
    """Load strictly: every missing, unexpected or mis-shaped key is listed."""
    state = read_checkpoint(path)
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(
        f"{k} {list(state[k].shape)} (module has {list(own[k].shape)})"
        for k in set(own) & set(state)
        if state[k].shape != own[k].shape
    )
    problems = [
        f"{label}: {', '.join(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
        if keys
    ]
    if problems:
        raise ConfigError("module.checkpoint", str(path), "keys do not match the module; " + "; ".join(problems))
    module.load_state_dict(state, strict=True)
    log.debug("loaded %d tensors from %s", len(state), path)
