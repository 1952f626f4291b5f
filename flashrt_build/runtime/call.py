"""One call of a loaded package: its inputs checked against the manifest
(a compiled package runs a wrong shape or an out-of-range index silently, or
aborts), then its own entry point with the input order and output tree read
once at load (and on a GPU maybe replayed from a CUDA graph), its threaded
state written back, its constant outputs restored."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..artifact import SINGLE_MODEL, STATE_KWARG
from .dtypes import dtype_name
from .gpu import fp32_precision
from .graphs import GraphCache
from .manifest import CAUSAL_LM_MEANING
from .threads import cpu_threads

log = logging.getLogger("flashrt_build")
Sizes = Mapping[tuple[str, str], str]  # (input, axis or "values") -> the key a user set that bounds it there


class PackageMethod:
    """One entry point of a loaded package: its model, input checks and call.

    Inputs may be passed by position or by name, like the eager method;
    constant keyword arguments fixed at build time (`use_cache`) are filled in,
    and passing a different value is an error, not a silent no-op. Buffers the
    method mutates are the package's shared `state`: written in place by the
    compiled code, or (threaded) passed in and written back after every call,
    so what one method writes the next one reads.
    """

    def __init__(
        self,
        name: str,
        runner: Any,
        entry: Mapping[str, Any],
        device: torch.device,
        tf32: bool | None,
        state: dict[str, torch.Tensor],
        lock: threading.Lock | None = None,
        graphs: GraphCache | None = None,
        threads: int | None = None,
        sizes: Sizes | None = None,  # a causal_lm package's keys that bound its inputs (`causal_lm_sizes`)
    ) -> None:
        self.name, self.runner = name, runner
        self.threads = threads  # CPU threads a call runs on; None: as this process is set
        self._lock = lock or threading.Lock()
        self._constant_kwargs = dict(entry.get("kwargs") or {})
        self._kwargs_key = "module.kwargs" if entry["model"] == SINGLE_MODEL else f"module.methods.{name}.kwargs"
        self._positional = [i["name"] for i in entry["inputs"] if i["positional"]]
        self._keyword = [i["name"] for i in entry["inputs"] if not i["positional"]]
        self._order = self._positional + self._keyword
        self._check = InputCheck(entry["inputs"], device, self._kwargs_key.removesuffix(".kwargs"), sizes)
        self._direct = DirectCall.of(runner, self._positional, set(self._keyword), set(self._constant_kwargs))
        if graphs is not None and self._direct is None:
            log.warning("%s: its call spec is not a flat list of inputs; it runs without CUDA graphs", name)
        elif self._direct is not None:
            self._direct.graphs = graphs
        self._tf32 = tf32
        # The threaded state (empty when the package writes its state in place).
        self._shared_state = state
        self._state_names = [name for name in entry.get("state") or [] if name in state]
        # Constants the method returns (None, an int): the compiled code gives them back as tensors.
        self._constants = [(i, o["value"]) for i, o in enumerate(entry.get("outputs") or []) if "value" in o]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs, values=True)

    def run_trusted(self, *args: Any, **kwargs: Any) -> Any:
        """A call without the check of declared value ranges, the one check
        that waits for the device (each ranged input's min and max come to
        the host), which stalls a loop that could queue its next step. Only
        for inputs derived from the package's own outputs: a token argmax-ed
        over the vocabulary, a position the caller counts. Shapes, dtypes and
        devices are still checked."""
        return self._call(args, kwargs, values=False)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], values: bool) -> Any:
        if len(args) > len(self._order):
            order = self._order
            raise TypeError(f"the package takes {len(order)} inputs ({', '.join(order)}), got {len(args)} positional")
        bound = dict(zip(self._order, args, strict=False))
        if kwargs:
            self._bind_keywords(bound, kwargs)
        if len(bound) < len(self._order):
            raise TypeError(f"missing inputs: {', '.join(n for n in self._order if n not in bound)}")
        self._check(bound, values)
        for name, value in bound.items():  # compiled code reads row-major: a view laid out otherwise reads wrong
            if not value.is_contiguous():
                bound[name] = value.contiguous()
        with self._lock, cpu_threads(self.threads):
            if self._tf32 is None:
                return self._run(bound)
            with fp32_precision(self._tf32):  # extern kernels (cuBLAS, cuDNN) read it on every call
                return self._run(bound)

    @property
    def graphs(self) -> GraphCache | None:
        """The CUDA graphs this method replays, by input shape (None: called plainly)."""
        return self._direct.graphs if self._direct is not None else None

    @graphs.setter
    def graphs(self, cache: GraphCache | None) -> None:
        if self._direct is not None:
            self._direct.graphs = cache

    def drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def _bind_keywords(self, bound: dict[str, Any], kwargs: dict[str, Any]) -> None:
        for key, value in kwargs.items():
            if key in self._constant_kwargs:
                if value != self._constant_kwargs[key]:
                    raise ValueError(
                        f"{key}={value!r} differs from the value the package was built with "
                        f"({self._constant_kwargs[key]!r}, {self._kwargs_key}.{key})"
                    )
                continue
            if key in bound or key not in self._order:
                problem = "given twice" if key in bound else "not an input of the package"
                raise TypeError(f"input '{key}' is {problem}; inputs: {', '.join(self._order)}")
            bound[key] = value

    def _run(self, bound: dict[str, torch.Tensor]) -> Any:
        state = {name: self._shared_state[name] for name in self._state_names}
        if self._direct is not None:
            out = self._direct(bound, state)
        else:  # the runner's own call, which flattens the inputs itself
            args = [bound[n] for n in self._positional]
            kwargs = {**{n: bound[n] for n in self._keyword}, **self._constant_kwargs}
            out = self.runner(*args, **kwargs, **({STATE_KWARG: state} if state else {}))
        if state:
            out, new_state = out
            for name, tensor in state.items():
                tensor.copy_(new_state[name])
        if self._constants:
            leaves, spec = pytree.tree_flatten(out)
            for index, value in self._constants:
                leaves[index] = value
            out = pytree.tree_unflatten(leaves, spec)
        return out


class DirectCall:
    """A package's own entry point (`boxed_run`) with its input order and
    output tree read once at load. torch's runner parses both and flattens the
    inputs on every call, which costs more than the call itself for a small
    model (24 of 39 microseconds for the mlp on the CPU)."""

    def __init__(self, loader: Any, order: list[str], out_spec: pytree.TreeSpec) -> None:
        self._run, self._order, self._out_spec = loader.boxed_run, order, out_spec
        self._state_prefix = f"{STATE_KWARG}."
        # What a graph copies in: the caller's inputs (threaded state is read where it is).
        self._copied = [i for i, name in enumerate(order) if not name.startswith(self._state_prefix)]
        self.graphs: GraphCache | None = None

    @classmethod
    def of(cls, runner: Any, positional: list[str], keyword: set[str], constants: set[str]) -> DirectCall | None:
        """The direct call of `runner`, or None when its call spec holds
        anything but the inputs, constant keyword arguments and threaded state."""
        loader = getattr(runner, "loader", None)
        if loader is None or not hasattr(loader, "boxed_run"):
            return None
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
        if len(args) != len(positional):
            return None
        slots = list(zip(args, positional, strict=True))
        for name, leaf in kwargs.items():
            if name == STATE_KWARG and isinstance(leaf, dict):
                slots += [(index, f"{STATE_KWARG}.{buffer}") for buffer, index in leaf.items()]
            elif name in keyword:
                slots.append((leaf, name))
            elif name not in constants:  # constants are no tensors: the package takes none for them
                return None
        if not all(isinstance(index, int) for index, _ in slots):
            return None
        return cls(loader, [name for _, name in sorted(slots)], out_spec)

    def __call__(self, inputs: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> Any:
        if state:
            inputs = {**inputs, **{self._state_prefix + name: t for name, t in state.items()}}
        flat = [inputs[name] for name in self._order]
        outputs = self._run(flat) if self.graphs is None else self.graphs(self._run, flat, self._copied)
        return pytree.tree_unflatten(outputs, self._out_spec)


def _dynamic_hint(name: str, axis: int, widest: int) -> str:
    """A batch axis, or a sequence of token ids, may well be made dynamic (a
    channel cannot): the override that builds it so, wide enough for the call."""
    low = 1 if axis == 0 else 2  # a sequence from 2, as the shipped configs' are
    dynamic = f"{{{axis}: {{min: {low}, max: {widest}}}}}"
    return f"; if the model takes other sizes there, build with '++module.inputs.{name}.dynamic={dynamic}'"


class InputCheck:
    """Refuses inputs the package was not built for: a compiled package runs a
    wrong shape silently, reading out of bounds. The rules are read from the
    manifest once; a call only compares."""

    def __init__(
        self, specs: list[dict[str, Any]], device: torch.device, key: str = "module", sizes: Sizes | None = None
    ) -> None:
        self._device_type = device.type
        self._device = device
        self._key = key
        self._sizes = dict(sizes or {})
        # Declared value ranges (token ids): a value outside one would make the
        # compiled code read out of bounds, which aborts the process.
        self._ranges = [
            (spec["name"], spec.get("low"), spec.get("high"))
            for spec in specs
            if spec.get("low") is not None or spec.get("high") is not None
        ]
        self._rules = [
            (
                spec["name"],
                getattr(torch, spec["dtype"]),
                spec,
                [(axis, size) for axis, size in enumerate(spec["shape"]) if str(axis) not in spec["dynamic"]],
                [(int(axis), d["min"], d["max"], d["name"]) for axis, d in spec["dynamic"].items()],
            )
            for spec in specs
        ]

    def __call__(self, inputs: Mapping[str, Any], values: bool = True) -> None:
        seen: dict[str, tuple[int, str]] = {}
        for name, dtype, spec, static, dynamic in self._rules:
            value = inputs[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"input '{name}' must be a tensor, got {type(value).__name__}")
            if value.dtype != dtype:
                raise TypeError(
                    f"input '{name}' has dtype {dtype_name(value.dtype)}; the package takes {spec['dtype']}"
                )
            if value.device.type != self._device_type:
                raise TypeError(f"input '{name}' is on {value.device}; the package runs on {self._device}")
            shape = value.shape
            if len(shape) != len(spec["shape"]):
                raise ValueError(
                    f"input '{name}' has {len(shape)} dims {list(shape)}; expected {len(spec['shape'])} "
                    f"like {spec['shape']}"
                )
            for axis, size in static:
                if shape[axis] != size:
                    floating = dtype.is_floating_point
                    hint = _dynamic_hint(name, axis, max(size, shape[axis])) if axis == 0 or not floating else ""
                    set_by = self._set_by(name, str(axis), size)
                    raise ValueError(
                        f"input '{name}' has size {shape[axis]} on axis {axis}; the package was built for {size} "
                        f"there ({set_by or 'a static axis'}){'' if set_by else hint}"
                    )
            for axis, low, high, dim in dynamic:
                size = shape[axis]
                if not low <= size <= high:
                    set_by = self._set_by(name, str(axis), high)
                    raise ValueError(
                        f"input '{name}' has size {size} on axis {axis} ('{dim}'); the package accepts {low} to {high}"
                        + (f" ({set_by})" if set_by else "")
                    )
                first = seen.setdefault(dim, (size, name))
                if first[0] != size:
                    raise ValueError(
                        f"inputs '{first[1]}' and '{name}' share dim '{dim}' but have sizes {first[0]} and {size}"
                    )
        if values and self._ranges:
            self._check_ranges(inputs)

    def _check_ranges(self, inputs: Mapping[str, Any]) -> None:
        checked = [(name, low, high) for name, low, high in self._ranges if inputs[name].numel()]
        if not checked:
            return
        # One pass per input and one transfer for all: a decode step on a GPU waits once, not twice per input.
        bounds = torch.stack([torch.stack(torch.aminmax(inputs[name])).to(torch.int64) for name, _, _ in checked])
        for (name, low, high), (smallest, largest) in zip(checked, bounds.tolist(), strict=True):
            self._check_range(name, smallest, largest, low, high)

    def _check_range(self, name: str, smallest: int, largest: int, low: int | None, high: int | None) -> None:
        if (low is not None and smallest < low) or (high is not None and largest >= high):
            accepted = f"{'-inf' if low is None else low} to {'inf' if high is None else high - 1}"
            set_by = self._set_by(name, "values", high) or f"{self._key}.inputs.{name}.low/high"
            raise ValueError(
                f"input '{name}' holds values from {smallest} to {largest}; the package accepts {accepted} "
                f"({set_by}): a value outside would make its code read out of bounds"
            )

    def _set_by(self, name: str, where: str, value: int | None) -> str | None:
        """`module.max_cache_len = 64: the positions its cache holds`; None where the input's own key bounds it."""
        key = self._sizes.get((name, where))
        return f"{key} = {value}: {CAUSAL_LM_MEANING[key]}" if key is not None else None
