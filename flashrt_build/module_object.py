"""A build from a module object, as `torch.export.export(model, args)` takes
one:

    flashrt_build.build(model, example_inputs=(x,), dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
                        weights="external")

The object becomes the config's module: its inputs from the examples (an
integer input's values from `input_ranges`, as the config's low/high), its
dynamic dimensions from `dynamic_shapes`, its `_target_` this module's
`given`, which hands the build a copy (the caller's object is never cast,
rewritten by a pass or put in eval mode). The rest is the config's, composed
by Hydra as the command line composes it (`overrides`), and the build is the
config's: exported, compiled, verified against the object as given, with a
manifest that records the object's class and source file.

What the object is keys the build: a digest of its pickle (class,
attributes and tensors), so an unchanged object's rebuild is up to date. An
object that does not pickle (a hook that is a local function) is built every
time, and the log says why. `release=true` refuses it: a release must be
rebuilt from its manifest, and no manifest can make an object again."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from .errors import ConfigError
from .runtime.dtypes import dtype_name
from .stages.objects import GIVEN, graph_code, handing, object_digest

log = logging.getLogger("flashrt_build")


def build_module(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | None,
    *,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    input_ranges: Mapping[str, tuple[int, int]] | None = None,
    name: str | None = None,
    weights: str = "baked",
    target: str = "cpu",
    dtype: str | None = None,
    output_root: str | Path | None = None,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    config_dir: str | Path | None = None,
    cwd: Path | None = None,
) -> Any:
    """Build `module` as a config of it would build: `example_inputs` its
    forward's positional inputs, `dynamic_shapes` torch.export's (by input
    name or position: {axis: Dim(name, min=, max=)}), `input_ranges` the
    values an integer input takes ({"ids": (0, vocab)}: verified over, and
    every call checked against), `weights` and `target`
    the config groups' values, `dtype` the target's (default: the module's
    floating dtype), `output_root` and `output_dir` where it goes (the
    keys'), `overrides` any other keys as the command line gives
    them (`["verify.rtol=1e-3", "output_root=builds"]`). Returns the
    BuildResult."""
    from .config.compose import compose
    from .pipeline import build

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(module).__name__}")
    module = _checked(module, overrides)
    inputs = module_inputs(module, example_inputs, dynamic_shapes, input_ranges)
    label = name if name is not None else _name_of(module)
    dtype = dtype or _floating_dtype(module)
    chosen = [f"weights={weights}", f"target={target}", *([f"target.dtype={dtype}"] if dtype else [])]
    for key, value in (("output_root", output_root), ("output_dir", output_dir), ("name", name)):
        if value is not None and (not isinstance(value, (str, Path)) or not str(value)):
            raise TypeError(f"{key}: expected a non-empty path or text, got {value!r}")
    chosen += [f"{key}={value}" for key, value in (("output_root", output_root), ("output_dir", output_dir)) if value]
    cfg = _not_a_release(compose([*chosen, *overrides], config_dir=config_dir))
    examples = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    digest, why = object_digest(module, graph_code(module, examples, dynamic_shapes))
    if why is not None:
        log.warning("%s: built every time: the object cannot be keyed by what it is (%s)", label, why)
    from omegaconf import OmegaConf, open_dict

    from .config.schema import ModuleConfig

    with open_dict(cfg):
        model = {"_target_": GIVEN, "digest": digest}
        cfg.module = OmegaConf.merge(
            OmegaConf.structured(ModuleConfig), {"name": label, "model": model, "inputs": inputs}
        )
    _check_namesake(cfg, cwd, module, name is None)
    with handing(digest, module):
        try:
            return build(cfg, cwd)
        except ConfigError as exc:  # a key the config of the object has, as the argument the caller gave
            raise as_argument(exc, list(inputs)) from None


def as_argument(error: ConfigError, names: list[str]) -> ConfigError:
    """A config error about the examples' `module.inputs`, named as the
    build's argument it came from: `input_ranges`, `dynamic_shapes`,
    `example_inputs`; any other as it is."""
    found = re.match(r"module\.inputs\.(\w+)(?:\.(\w+))?(?:\.(\d+))?", error.key)
    if error.kind != "config key" or found is None or found.group(1) not in names:
        return error
    name, part, axis = found.groups()
    if part in ("low", "high"):
        key = f"input_ranges[{name!r}]"
    elif part == "dynamic":
        key = f"dynamic_shapes[{name!r}]" + (f"[{axis}]" if axis else "")
    else:
        key = f"example_inputs[{names.index(name)}]"
    return ConfigError(key, error.value, error.expected, "argument")


def _checked(module: torch.nn.Module, overrides: Sequence[str]) -> torch.nn.Module:
    """The module to build, its `overrides` checked: a list of texts, none of
    them the `module` the object is; torch.compile's wrapper gives its module."""
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        expected = "expected a list of key=value texts, as the command line gives them"
        raise TypeError(f"overrides: {expected}, got {overrides!r}")
    if taken := [o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] == "module"]:
        expected = "the module is the object given (name=... names it; its inputs are the examples)"
        raise ConfigError("overrides", taken, expected, "argument")
    wrapped = getattr(module, "_orig_mod", None)
    if isinstance(wrapped, torch.nn.Module):
        log.info("building the module torch.compile wraps (%s): AOTInductor compiles it", type(wrapped).__name__)
        return wrapped
    return module


def module_inputs(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | None,
    dynamic_shapes: Any = None,
    input_ranges: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """`module.inputs` for the examples: each named as forward names it,
    passed positionally, its shape, dtype, dynamic axes and (an integer
    input's, from `input_ranges`) the values it takes, low inclusive, high
    exclusive."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        expected = "expected a tuple of the forward's tensors: (x,)"
        raise ConfigError("example_inputs", example_inputs, expected, "argument")
    names = _input_names(module, len(example_inputs))
    dims = _dynamic_by_name(dynamic_shapes, names)
    ranges = dict(input_ranges or {})
    if unknown := sorted(set(ranges) - set(names)):
        raise ConfigError("input_ranges", unknown, f"names no input; the inputs are {', '.join(names)}", "argument")
    inputs: dict[str, dict[str, Any]] = {}
    for index, (name, value) in enumerate(zip(names, example_inputs, strict=True)):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"example_inputs[{index}]", type(value).__name__, "expected a tensor", "argument")
        entry: dict[str, Any] = {"shape": list(value.shape), "dtype": dtype_name(value.dtype), "positional": True}
        if name in ranges:
            entry |= _range(name, ranges[name], value)
        elif not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            log.warning(
                "%s: an integer input of no declared range: verified on values 0 and 1, and any value is taken; "
                "input_ranges={%r: (low, high)} verifies and guards the values it takes (token ids: the vocabulary)",
                name, name,
            )  # fmt: skip
        entry["dynamic"] = {axis: _dim(name, axis, dim, value) for axis, dim in (dims.get(name) or {}).items()}
        inputs[name] = entry
    return inputs


def _input_names(module: torch.nn.Module, count: int) -> list[str]:
    parameters = [
        p for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    names = [p.name for p in parameters[:count]]
    if len(names) < count:
        raise ConfigError(
            "example_inputs",
            f"{count} tensors",
            f"{type(module).__name__}.forward takes {len(names)} positionally ({', '.join(names) or 'none'})",
            "argument",
        )
    return names


def _dynamic_by_name(dynamic_shapes: Any, names: list[str]) -> dict[str, Mapping[int, Any]]:
    """torch.export's `dynamic_shapes` (a dict by input name, or a tuple by
    position; each {axis: Dim} or None) by input name."""
    if dynamic_shapes is None:
        return {}
    if isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) != len(names):
            raise ConfigError("dynamic_shapes", f"{len(dynamic_shapes)} entries",
                              f"one per example input ({len(names)})", "argument")  # fmt: skip
        dynamic_shapes = dict(zip(names, dynamic_shapes, strict=True))
    if not isinstance(dynamic_shapes, Mapping):
        raise ConfigError("dynamic_shapes", type(dynamic_shapes).__name__,
                          "expected {input name: {axis: Dim(name, min=, max=)}}", "argument")  # fmt: skip
    unknown = sorted(set(dynamic_shapes) - set(names))
    if unknown:
        raise ConfigError("dynamic_shapes", unknown, f"names no input; the inputs are {', '.join(names)}", "argument")
    found = {}
    for name, axes in dynamic_shapes.items():
        if axes is not None and not isinstance(axes, Mapping):
            raise ConfigError(f"dynamic_shapes[{name!r}]", axes, "expected {axis: Dim(name, min=, max=)}", "argument")
        found[name] = axes or {}
    return found


def _range(name: str, given: Any, value: torch.Tensor) -> dict[str, int]:
    key = f"input_ranges[{name!r}]"
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        what = f"{name} is {dtype_name(value.dtype)}: a range is for an integer input"
        raise ConfigError(key, given, what, "argument")
    if not (isinstance(given, (tuple, list)) and len(given) == 2 and all(isinstance(v, int) for v in given)):
        raise ConfigError(key, given, "expected (low, high): low inclusive, high exclusive", "argument")
    low, high = given
    if value.numel() and not (low <= int(value.min()) and int(value.max()) < high):
        what = f"the example holds {int(value.min())} to {int(value.max())}, outside it"
        raise ConfigError(key, given, what, "argument")
    return {"low": low, "high": high}


def _dim(name: str, axis: Any, dim: Any, value: torch.Tensor) -> dict[str, Any]:
    """A Dim with finite bounds as the config's {name, min, max}: the package
    is verified at its min, between and at its max, so both must be given."""
    key = f"dynamic_shapes[{name!r}][{axis}]"
    if not isinstance(axis, int) or not 0 <= axis < value.dim():
        raise ConfigError(key, axis, f"expected an axis of {name}, 0..{value.dim() - 1}", "argument")
    low, high = getattr(dim, "min", None), getattr(dim, "max", None)
    dim_name = getattr(dim, "__name__", None)
    if not isinstance(dim_name, str) or not isinstance(low, int) or not isinstance(high, int) or high > 2**31:
        raise ConfigError(
            key,
            str(dim),
            "expected torch.export.Dim(name, min=..., max=...) with both bounds: the package is verified at its "
            "least, an odd size between and its greatest",
            "argument",
        )
    return {"name": dim_name, "min": max(low, 1), "max": high}


def _not_a_release(cfg: Any) -> Any:
    if cfg.get("release"):
        raise ConfigError(
            "release",
            True,
            "a module object cannot be a release: repro rebuilds a release from its manifest, which cannot make "
            "the object again; give its class as module.model._target_ in a config",
        )
    return cfg


def _check_namesake(cfg: Any, cwd: Path | None, module: torch.nn.Module, named_by_class: bool) -> None:
    """The folder named after the object's class holds no build of another
    class of that name (`pkga.net.Net` and `pkgb.net.Net`): its artifact
    would be replaced by another model's."""
    import json

    from .config.paths import derive_output_dir
    from .stages.preflight import real_name

    if not named_by_class or cfg.get("output_dir"):
        return
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # the folder as the build derives it
    manifest = derive_output_dir(cast(dict[str, Any], config), cwd or Path.cwd()) / "manifest.json"
    try:
        built = (json.loads(manifest.read_text()).get("module") or {}).get("object") or {}
    except (OSError, ValueError, AttributeError):
        return
    if built.get("class") not in (None, real_name(type(module))):
        raise ConfigError(
            "name", None, f"{manifest.parent} holds the build of {built['class']}, another class than "
            f"{real_name(type(module))}: name=... gives this one a folder of its own", "argument",
        )  # fmt: skip


def _name_of(module: torch.nn.Module) -> str:
    """The output folder's name for an object: its class's, lowercased."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", type(module).__name__).lower() or "module"


def _floating_dtype(module: torch.nn.Module) -> str | None:
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return dtype_name(tensor.dtype)
    return None
