"""Graph passes (the `passes` group), run on the module before its export so
every later stage, verification included, sees their result.

`fuse_projections`: linear layers that read the same input in one call
(attention's q/k/v, an MLP's gate/up) become one matmul over their
concatenated weights, its output split after it: a one-token decode step
launches one larger GEMM instead of two or three small ones. The fused
weight is a parameter of the layers' parent (`...self_attn.q_proj__k_proj__v_proj.weight`);
the manifest maps its rows back to the checkpoint's tensors.

`grouped_attention` (attention.py): grouped-query attention over the KV
cache as it is, not copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config.spec import BuildSpec
from .attention import group_attention
from .domain import preserved_buffers
from .export import calling
from .inputs import make_inputs
from .progress import Stage


@dataclass(frozen=True)
class Group:
    """Linear layers (FQNs, in call order) that read one input."""

    members: tuple[str, ...]

    @property
    def parent(self) -> str:
        return self.members[0].rpartition(".")[0]

    @property
    def fused(self) -> str:
        """The fused layer's FQN: the members' own names, joined."""
        local = "__".join(m.rpartition(".")[2] for m in self.members)
        return f"{self.parent}.{local}" if self.parent else local


def passes_stage(module: nn.Module, spec: BuildSpec) -> Stage[None]:
    """Apply the config's passes to `module` in place; the manifest's `passes`."""
    section: dict[str, Any] = {"name": spec.passes}
    notes = []
    if spec.fuse_projections:
        groups = projection_groups(module, spec)
        fused = [fuse(module, group) for group in groups]
        calls = sum(len(g.members) for g in groups)
        notes.append(f"fuse_projections: {calls} linear layers into {len(groups)} matmuls" if groups else
                     "nothing to fuse")  # fmt: skip
        section["fuse_projections"] = {"linear_calls_cut": calls - len(groups), "fused": fused}
    if spec.grouped_attention:
        switched = group_attention(module)
        notes.append(f"grouped_attention: {switched} model(s)" if switched else "grouped_attention: no grouped heads")
        section["grouped_attention"] = {"models": switched}
    return Stage(None, "; ".join(notes) or "none", {"passes": section} if len(section) > 1 else {})


def projection_groups(module: nn.Module, spec: BuildSpec) -> list[Group]:
    """The groups of plain `nn.Linear` layers (two or more, one parent, the
    same input size, dtype and bias) that each method's example call feeds
    the very same input tensor, each layer called once."""
    calls: list[tuple[torch.Tensor, str]] = []  # (input, layer), the inputs kept alive: ids stay unique
    names: dict[nn.Module, str] = {
        m: n for n, m in module.named_modules() if type(m) is nn.Linear and type(m.weight) is nn.Parameter
    }

    def record(layer: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            calls.append((args[0], names[layer]))

    hooks = [layer.register_forward_pre_hook(record) for layer in names]
    try:
        with torch.no_grad(), preserved_buffers(module):
            for method in spec.methods:
                example = make_inputs(spec, method=method)
                with calling(module, method):
                    module(*example.args, **example.kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    times: dict[str, int] = {}
    by_input: dict[int, list[str]] = {}
    for tensor, name in calls:
        times[name] = times.get(name, 0) + 1
        by_input.setdefault(id(tensor), []).append(name)
    layers = dict(module.named_modules())
    groups = []
    for members in by_input.values():
        once = [m for m in dict.fromkeys(members) if times[m] == len(spec.methods)]
        for kept in _compatible(once, layers):
            groups.append(Group(tuple(kept)))
    return [g for g in dict.fromkeys(groups) if len(g.members) > 1]


def _compatible(members: list[str], layers: dict[str, nn.Module]) -> list[list[str]]:
    """`members` split into runs that can share one matmul."""
    runs: dict[tuple[Any, ...], list[str]] = {}
    for name in members:
        layer = layers[name]
        assert isinstance(layer, nn.Linear)
        kind = (name.rpartition(".")[0], layer.in_features, layer.weight.dtype, layer.weight.device, layer.bias is None)
        runs.setdefault(kind, []).append(name)
    return list(runs.values())


def fuse(module: nn.Module, group: Group) -> dict[str, Any]:
    """Replace the group's layers by views of one fused layer; its record:
    the fused weight (and bias) and the rows each original tensor holds."""
    parent = module.get_submodule(group.parent) if group.parent else module
    layers = [layer for m in group.members if isinstance(layer := module.get_submodule(m), nn.Linear)]
    rows = [layer.out_features for layer in layers]
    biases = [layer.bias.detach() for layer in layers if layer.bias is not None]
    shared = FusedLinear(
        torch.cat([layer.weight.detach() for layer in layers]), torch.cat(biases) if biases else None, rows
    )
    local = group.fused.rpartition(".")[2]
    parent.add_module(local, shared)
    for index, member in enumerate(group.members):
        parent.add_module(member.rpartition(".")[2], FusedSlice(shared, index))
    parts, start = [], 0
    for member, count in zip(group.members, rows, strict=True):
        parts.append({"name": f"{member}.weight", "rows": [start, start + count]})
        start += count
    record: dict[str, Any] = {"weight": f"{group.fused}.weight", "from": parts}
    if shared.bias is not None:
        record["bias"] = f"{group.fused}.bias"
    return record


class FusedLinear(nn.Module):
    """The group's layers as one: computed once per input, each slice served
    to the layer it stands for. A new input (or one changed in place since)
    computes again, so a call that feeds the layers different inputs still
    gets each its own right output."""

    rows: list[int]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: list[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.rows = rows
        # [input, its version, the outputs, slices served]; a list, changed in
        # place: export sees no module attribute assigned during the trace
        self._last: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def slice_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if not self._last or self._last[0] is not x or self._last[1] != x._version:
            self._last[:] = [x, x._version, self(x).split(self.rows, dim=-1), 0]
        out = self._last[2][index]
        self._last[3] += 1
        if self._last[3] == len(self.rows):  # every layer served: hold nothing past the call
            self._last.clear()
        return out


class FusedSlice(nn.Module):
    """Stands where one of a fused group's layers stood: its rows of the
    fused output. Holds no parameter (the fused layer is the parent's)."""

    _shared: FusedLinear
    index: int

    def __init__(self, shared: FusedLinear, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_shared", shared)  # not a submodule: its weight is counted once
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.slice_of(self.index, x)
