"""Stage 3: example tensors (seeded) and torch.export dynamic shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim, ShapesCollection

from ..config.spec import FLOAT_DTYPES, BuildSpec, InputSpec, MethodSpec


@dataclass
class ExampleInputs:
    """Positional and keyword arguments for one call of the module."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def make_tensor(spec: InputSpec, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """One example tensor, drawn on CPU so every device sees the same values
    for the same seed."""
    if spec.dtype in FLOAT_DTYPES:
        return torch.randn(*shape, generator=generator).to(torch_dtype(spec.dtype))
    if spec.dtype == "bool":
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    low = 0 if spec.low is None else spec.low
    high = (low + 2) if spec.high is None else spec.high
    return torch.randint(low, high, tuple(shape), generator=generator, dtype=torch_dtype(spec.dtype))


def make_inputs(
    spec: BuildSpec,
    seed: int | None = None,
    sizes: Mapping[str, int] | None = None,
    method: MethodSpec | None = None,
) -> ExampleInputs:
    """Example inputs for a method of `spec` (its default one unless given);
    `sizes` overrides dynamic dims by dim name."""
    method = method or spec.default_method
    generator = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    args: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    for inp in method.inputs:
        shape = list(inp.shape)
        for axis, dim in inp.dynamic.items():
            if sizes and dim.name in sizes:
                shape[axis] = sizes[dim.name]
        tensor = make_tensor(inp, shape, generator).to(spec.device)
        if inp.positional:
            args.append(tensor)
        else:
            kwargs[inp.name] = tensor
    kwargs.update(method.kwargs)
    return ExampleInputs(tuple(args), kwargs)


def dynamic_shapes(spec: BuildSpec, example: ExampleInputs, method: MethodSpec | None = None) -> ShapesCollection:
    """Map each example tensor to its dynamic axes; axes sharing a name share a Dim."""
    inputs = (method or spec.default_method).inputs
    dims = {d.name: Dim(_identifier(d.name), min=d.min, max=d.max) for inp in inputs for d in inp.dynamic.values()}
    shapes = ShapesCollection()
    tensors = iter(example.args)
    for inp in inputs:
        tensor = next(tensors) if inp.positional else example.kwargs[inp.name]
        if inp.dynamic:
            shapes[tensor] = {axis: dims[d.name] for axis, d in inp.dynamic.items()}
    return shapes


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)
