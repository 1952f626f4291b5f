"""The checks of a resolved config that need torch, in one step right after
resolving and before any work: Inductor's option names and types, the
device, entry-point names a loaded package's own attributes would shadow,
and every `_target_` located as Hydra locates it and checked against the
allow-list by what it really is. Every problem is reported at once, as the
config's own checks (flashrt_build/config/) do; checks of the module itself
(its checkpoint, its inputs) are its stages'."""

from __future__ import annotations

import difflib
import inspect
import pkgutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from hydra._internal.utils import _locate

from ..config.problems import Problems, raise_all
from ..config.schema import WeightsMode
from ..config.spec import BuildSpec
from ..config.targets import find_targets, target_allowed
from ..errors import ConfigError, first_lines
from ..runtime.load import attribute_names
from .compile import FORCED_OPTIONS, mode_options


def preflight(spec: BuildSpec) -> dict[str, Any]:
    """Raise every problem found; return the Inductor options to compile with."""
    problems = Problems()
    options = problems.check(validate_inductor_options, spec.inductor_options, spec.weights)
    for name, own in spec.method_inductor_options.items():
        problems.check(validate_inductor_options, own, spec.weights, f"inductor.methods.{name}")
    if spec.quant is not None:  # the recipe's configs, arguments and GPU, before the module is built
        from .quantize import torchao_configs

        problems.check(torchao_configs, spec.quant, spec.device)
    problems.check(check_device, spec.device)
    problems.check(check_method_names, spec)
    problems.check(check_targets, spec)
    problems.raise_all()
    assert options is not None
    return options


def check_method_names(spec: BuildSpec) -> None:
    """An entry point named like an attribute of every loaded package
    (`training`, `to`, `state`...) would be shadowed by it: `m.NAME` must reach it."""
    if not spec.multi_method:
        return  # a lone forward is `m(...)`
    taken = attribute_names()
    raise_all(
        [
            ConfigError(
                m.key,
                m.name,
                "is a LoadedModule attribute (every loaded package has it), which would shadow this method; "
                "name the entry point otherwise",
            )
            for m in spec.methods
            if m.name in taken and not (m.name == "forward" and m.attr == "forward")  # m.forward() runs it anyway
        ]
    )


def locate_target(target: str, key: str = "module.model._target_") -> Any:
    """The object a dotted `_target_` names, found the way Hydra's instantiate
    finds it (modules, then attributes: a class method or a factory is a
    target too), or a ConfigError naming the key."""
    try:
        return _locate(target)
    except Exception as exc:
        cause = exc.__cause__ or exc
        missing = cause.name if isinstance(cause, ModuleNotFoundError) else None
        own = missing is not None and f"{target}.".startswith(f"{missing}.")  # not a dependency's missing module
        why = (own and _missing_name(target)) or f"{type(cause).__name__}: {first_lines(cause, 1)}"
        raise ConfigError(key, target, f"cannot be imported ({why})") from None


def _missing_name(target: str) -> str | None:
    """`mymodels.net.Nett`: the module imported, the name is not in it; say
    so with its closest name, where Hydra says 'mymodels.net is not a
    package'. Only modules Hydra's attempt imported are looked in; none is imported here."""
    parts = target.split(".")
    for end in range(len(parts) - 1, 0, -1):
        found: Any = sys.modules.get(".".join(parts[:end]))
        if found is None:
            continue
        for at in range(end, len(parts)):
            if not hasattr(found, parts[at]):
                where = ".".join(parts[:at])
                names = [n for n in dir(found) if not n.startswith("_")]
                names += [m.name for m in pkgutil.iter_modules(getattr(found, "__path__", []))]  # not yet imported
                close = difflib.get_close_matches(parts[at], names, n=1)
                return f"{where} has no {parts[at]!r}" + (f"; did you mean {where}.{close[0]}?" if close else "")
            found = getattr(found, parts[at])
        return None
    return None


def real_name(obj: Any) -> str | None:
    """`module.qualname` of what a target really is (a bound class method by
    its function), or None for an object that does not say."""
    function = getattr(obj, "__func__", obj)
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def source_file(obj: Any) -> str | None:
    """The file an object's code is in, or None where it has none (a builtin,
    a class defined in `python -c`, a notebook's kernel or `python - < file`,
    whose '<stdin>' is no file)."""
    try:
        source = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None
    return source if source and Path(source).is_file() else None


def check_targets(spec: BuildSpec) -> None:
    """Every `_target_` of the module, at any depth, located and, when
    `allowed_targets` (or the release profile) restricts them, checked by what
    the object really is, before anything is instantiated."""
    patterns = list(spec.allowed_targets)
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


def check_device(device: str) -> None:
    """A CUDA target needs that GPU here: a ConfigError naming what is missing."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else "none is visible"
        raise ConfigError("target.device", device, f"no CUDA device is available here: {why} (use target=cpu)")
    index, count = torch.device(device).index or 0, torch.cuda.device_count()
    if index >= count:
        raise ConfigError("target.device", device, f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")


def validate_inductor_options(
    options: Mapping[str, Any], weights: WeightsMode = WeightsMode.baked, key: str = "inductor.options"
) -> dict[str, Any]:
    """Check option names and value types against torch's Inductor config and
    add the options flashrt_build sets itself; `key`: where the options were
    given, for messages."""
    forced = {**FORCED_OPTIONS, **mode_options(weights)}
    known = torch._inductor.config.get_config_copy()
    problems = []
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(
                ConfigError(f"{key}.{name}", value, f"not an Inductor option in torch {torch.__version__}{hint}")
            )
            continue
        default = known[name]
        if isinstance(default, bool) and not isinstance(value, bool):
            problems.append(ConfigError(f"{key}.{name}", value, "expected true or false"))
        elif name in forced and value != forced[name]:
            problems.append(ConfigError(f"{key}.{name}", value, f"flashrt_build sets {forced[name]!r} here"))
    raise_all(problems)
    return {**options, **forced}
