"""A config's entry points: each method of the module the package exposes,
its inputs (shapes, dtypes, dynamic dims, value ranges) and constant keyword
arguments, resolved and checked without torch."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..artifact import SINGLE_MODEL
from ..errors import ConfigError
from ..runtime.dtypes import ALIASES, INTEGER

# Names that become file and directory names: module names, variants, input names.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # \Z: `$` takes a name ending in a newline
MAX_NAME = 96  # a folder name: a file name holds 255 bytes, and the lock and staging names add to it
NAME_RULE = f"at most {MAX_NAME} letters, digits, '_', '.', '-', the first a letter or digit"


def is_name(text: object) -> TypeGuard[str]:
    """Whether `text` may name a folder: NAME's characters, at most MAX_NAME of them."""
    return isinstance(text, str) and NAME.match(text) is not None and len(text) <= MAX_NAME


@dataclass(frozen=True)
class DimSpec:
    name: str
    min: int
    max: int


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    dynamic: Mapping[int, DimSpec]
    # The values an integer input may hold, low inclusive, high exclusive (a
    # token id below the vocabulary size); None: not declared. Examples are
    # drawn from it and every call of the package is checked against it.
    low: int | None
    high: int | None
    positional: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "dynamic": {
                str(axis): {"name": d.name, "min": d.min, "max": d.max} for axis, d in sorted(self.dynamic.items())
            },
            "positional": self.positional,
            "low": self.low,
            "high": self.high,
        }


@dataclass(frozen=True)
class MethodSpec:
    """One entry point of the package: a module method and its inputs."""

    name: str  # how users call it: m(...) for forward, m.NAME(...) otherwise
    attr: str  # the module method it calls
    inputs: tuple[InputSpec, ...]
    kwargs: Mapping[str, Any]
    model: str  # its model inside the .pt2
    key: str  # its config key, for messages: `module` or `module.methods.NAME`

    @property
    def label(self) -> str:
        """How logs and errors name it: the method, unless it is a lone forward."""
        return "" if self.model == SINGLE_MODEL else self.name

    @property
    def positional(self) -> tuple[InputSpec, ...]:
        return tuple(i for i in self.inputs if i.positional)

    @property
    def keyword(self) -> tuple[InputSpec, ...]:
        return tuple(i for i in self.inputs if not i.positional)

    def call_args(self, values: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Inputs by name, split as the method takes them: positional ones in order, then keywords."""
        return [values[i.name] for i in self.positional], {i.name: values[i.name] for i in self.keyword}


def canonical_dtype(key: str, name: object) -> str:
    """The torch name of a dtype given in a config, or a ConfigError."""
    if isinstance(name, str) and name in ALIASES:
        return ALIASES[name]
    raise ConfigError(key, name, f"expected a dtype name, one of {sorted(set(ALIASES.values()))}")


def resolve_methods(module: Mapping[str, Any], check: Callable[..., Any]) -> list[MethodSpec]:
    """The package's entry points: `module.methods`, or the forward of `module.inputs`."""
    declared = module.get("methods") or {}
    if not declared:
        if not module["inputs"]:
            check(_fail, "module.inputs", {}, "expected at least one input (or module.methods, one entry per method)")
        entries = [("forward", "forward", module["inputs"], module.get("kwargs") or {}, SINGLE_MODEL, "module")]
    else:
        for key in ("inputs", "kwargs"):
            if module.get(key):
                check(_fail, f"module.{key}", module[key], f"with module.methods, give each method's {key} there")
        entries = [
            (name, raw.get("method") or name, raw["inputs"], raw.get("kwargs") or {}, name, f"module.methods.{name}")
            for name, raw in declared.items()
        ]
    methods = []
    for name, attr, raw_inputs, kwargs, model, key in entries:
        if not name.isidentifier() or name.startswith("_"):
            check(_fail, key, name, "a method name must be a public Python identifier")
        if not isinstance(attr, str) or not attr.isidentifier():
            check(_fail, f"{key}.method", attr, "expected the name of a method of the module")
        if declared and not raw_inputs:
            check(_fail, f"{key}.inputs", {}, "expected at least one input")
        inputs = tuple(
            spec
            for spec in (check(_resolve_input, in_name, raw, key) for in_name, raw in raw_inputs.items())
            if spec is not None
        )
        check(_check_shared_dims, inputs, key)
        methods.append(MethodSpec(name, attr, inputs, dict(kwargs), model, key))
    return methods


def _fail(key: str, value: object, expected: str) -> None:
    raise ConfigError(key, value, expected)


def _resolve_input(name: str, raw: Mapping[str, Any], method_key: str = "module") -> InputSpec:
    key = f"{method_key}.inputs.{name}"
    if not NAME.match(name) or "." in name:
        raise ConfigError(key, name, "an input name must be a Python identifier")
    shape = tuple(raw["shape"])
    if any(not isinstance(n, int) or n <= 0 for n in shape):
        raise ConfigError(f"{key}.shape", list(shape), "expected positive integer sizes")
    dtype = canonical_dtype(f"{key}.dtype", raw["dtype"])
    dynamic: dict[int, DimSpec] = {}
    for raw_axis, rng in (raw.get("dynamic") or {}).items():
        dkey = f"{key}.dynamic.{raw_axis}"
        axis = int(raw_axis) if str(raw_axis).lstrip("-").isdigit() else None
        if axis is None or not 0 <= axis < len(shape):
            raise ConfigError(f"{key}.dynamic", raw_axis, f"expected an integer axis in [0, {len(shape)})")
        lo, hi = rng["min"], rng["max"]
        if lo < 1 or hi < lo:
            raise ConfigError(dkey, {"min": lo, "max": hi}, "expected 1 <= min <= max")
        if not lo <= shape[axis] <= hi:
            raise ConfigError(
                f"{key}.shape", list(shape), f"axis {axis} = {shape[axis]} lies outside its dynamic range [{lo}, {hi}]"
            )
        dynamic[axis] = DimSpec(name=rng.get("name") or f"{name}_{axis}", min=lo, max=hi)
    low, high = raw.get("low"), raw.get("high")
    if (low is not None or high is not None) and dtype not in INTEGER:
        which = "low" if low is not None else "high"
        raise ConfigError(f"{key}.{which}", raw[which], f"low/high apply to integer inputs only; this one is {dtype}")
    if low is not None and high is not None and high <= low:
        raise ConfigError(f"{key}.high", high, f"expected high > low = {low}")
    return InputSpec(name, shape, dtype, dynamic, low, high, bool(raw.get("positional")))


def _check_shared_dims(inputs: tuple[InputSpec, ...], method_key: str = "module") -> None:
    """Axes that share a dim name must agree on its range and example size."""
    seen: dict[str, tuple[DimSpec, int, str]] = {}
    for spec in inputs:
        for axis, dim in spec.dynamic.items():
            where = f"{method_key}.inputs.{spec.name}.dynamic.{axis}"
            if dim.name in seen:
                first, size, first_where = seen[dim.name]
                if (first.min, first.max, size) != (dim.min, dim.max, spec.shape[axis]):
                    raise ConfigError(
                        where, dim.name, f"dim '{dim.name}' must match {first_where} (range and example size)"
                    )
            else:
                seen[dim.name] = (dim, spec.shape[axis], where)
