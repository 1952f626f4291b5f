"""Example tensors (seeded) and torch.export dynamic shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim, ShapesCollection

from ..config.inputs import InputSpec, MethodSpec
from ..config.spec import BuildSpec
from ..errors import BuildError, first_lines
from ..runtime.dtypes import FLOATING


@dataclass
class ExampleInputs:
    """Positional and keyword arguments for one call of the module."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def named(self, method: MethodSpec) -> dict[str, Any]:
        """The inputs by name: the positional ones matched to their names."""
        return dict(zip((i.name for i in method.positional), self.args, strict=True)) | self.kwargs


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def value_range(spec: InputSpec) -> tuple[int, int]:
    """[low, high) an integer input's example values come from: its declared
    range, or 0 and 1 where the config is silent."""
    low = 0 if spec.low is None else spec.low
    return low, (low + 2) if spec.high is None else spec.high


def make_tensor(
    spec: InputSpec, shape: Sequence[int], generator: torch.Generator, edge: str | None = None
) -> torch.Tensor:
    """One example tensor, drawn on CPU so every device sees the same values
    for the same seed. `edge` ("low", "high" or "both") fills an integer
    input with the ends of its declared range instead: its lowest value, its
    highest, or the highest with the lowest first."""
    if spec.dtype in FLOATING:
        return torch.randn(*shape, generator=generator).to(torch_dtype(spec.dtype))
    if spec.dtype == "bool":
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    low, high = value_range(spec)
    dtype = torch_dtype(spec.dtype)
    if edge is None:
        return torch.randint(low, high, tuple(shape), generator=generator, dtype=dtype)
    tensor = torch.full(tuple(shape), low if edge == "low" else high - 1, dtype=dtype)
    if edge == "both" and tensor.numel():
        tensor.view(-1)[0] = low
    return tensor


def make_inputs(
    spec: BuildSpec,
    seed: int | None = None,
    sizes: Mapping[str, int] | None = None,
    method: MethodSpec | None = None,
    edges: Mapping[str, str] | None = None,
) -> ExampleInputs:
    """Example inputs for a method of `spec` (its default one unless given);
    `sizes` overrides dynamic dims by dim name, `edges` fills integer inputs
    (by name) with the ends of their range (see `make_tensor`). Tensors only:
    constant keyword arguments are the method's own (`method.kwargs`)."""
    method = method or spec.default_method
    generator = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    args: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    for inp in method.inputs:
        shape = list(inp.shape)
        for axis, dim in inp.dynamic.items():
            if sizes and dim.name in sizes:
                shape[axis] = sizes[dim.name]
        tensor = _allocated(inp, shape, generator, (edges or {}).get(inp.name), spec.device, method.key)
        if inp.positional:
            args.append(tensor)
        else:
            kwargs[inp.name] = tensor
    return ExampleInputs(tuple(args), kwargs)


def _allocated(
    inp: InputSpec, shape: list[int], generator: torch.Generator, edge: str | None, device: str, key: str
) -> torch.Tensor:
    """An example tensor on its device; one it cannot allocate fails the build naming its input."""
    try:
        return make_tensor(inp, shape, generator, edge).to(device)
    except (RuntimeError, MemoryError) as exc:
        size = torch.Size(shape).numel() * torch_dtype(inp.dtype).itemsize
        raise BuildError(
            f"could not allocate the example input {key}.inputs.{inp.name} of shape {shape} "
            f"({size / 1e9:.3g} GB) on {device}: {first_lines(exc, 1)}"
        ) from None


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
