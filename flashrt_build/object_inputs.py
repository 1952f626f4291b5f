"""The config's `module.inputs` from a module object's example inputs (as
`torch.export.export` takes them: tensors, `dynamic_shapes` of Dims, and
`input_ranges` for integer inputs), and a config error about them named as
the argument of `build(model, ...)` it came from."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import ConfigError
from .runtime.dtypes import dtype_name
from .stages.objects import GIVEN

log = logging.getLogger("flashrt_build")


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


def inputs_as_arguments(message: str, names: list[str]) -> str:
    """`module.inputs.x` in a stage's message, as the argument it came from."""
    return re.sub(
        r"module\.inputs\.(\w+)",
        lambda m: f"example_inputs[{names.index(m[1])}] ({m[1]})" if m[1] in names else m[0],
        message,
    )


def as_argument(error: ConfigError, names: list[str], given: str = "the module") -> ConfigError:
    """A config error about the examples' `module.inputs`, named as the
    build's argument it came from: `input_ranges`, `dynamic_shapes`,
    `example_inputs`; one that names the object's stand-in `_target_`
    names `given` (its class) and `name=`; any other as it is."""
    if error.key == "output_dir" and GIVEN in error.expected:
        expected = error.expected.replace(GIVEN, f"the {given} object").replace("module.name=NAME", "name=NAME")
        return ConfigError("output_dir", error.value, expected, "argument")
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
