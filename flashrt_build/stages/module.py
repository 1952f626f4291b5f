"""Stage 2: instantiate the module, load its checkpoint strictly, cast it."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ..config.spec import BuildSpec
from ..errors import ConfigError, InstantiateError, first_lines
from ..runtime.checkpoint import read_checkpoint
from .inputs import torch_dtype

log = logging.getLogger(__name__)


def import_target(target: str) -> object:
    """Import a dotted `_target_` or raise a ConfigError naming it."""
    module_path, _, attr = target.rpartition(".")
    try:
        obj = importlib.import_module(module_path) if module_path else None
        return getattr(obj, attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError("module.model._target_", target, f"cannot be imported ({exc})") from None


def instantiate_module(spec: BuildSpec) -> torch.nn.Module:
    """Build the `nn.Module`, seeded, in eval mode, on the target device and dtype."""
    import_target(spec.target)  # an unimportable target is a config error, not a build error
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
