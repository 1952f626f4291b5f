"""The layers the `fuse_projections` pass puts in a module: one Linear for
a group of layers that read one input, and a slice of its output standing
where each of them stood. A Linear itself, so a `quant` recipe quantizes the
fused weight as it would the members' (decided by their names, `quantize.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """The group's layers as one: computed once per input, each slice served
    to the layer it stands for. A new input (or one changed in place since)
    computes again, so a call that feeds the layers different inputs still
    gets each its own right output."""

    rows: list[int]
    members: tuple[str, ...]  # the FQNs of the layers it stands for, in row order

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rows: list[int], members: tuple[str, ...]
    ) -> None:
        nn.Module.__init__(self)  # nn.Linear's own would allocate weights the concatenation replaces
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.rows = rows
        self.members = members
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

    # The layer's own tensors, as code that read them before the fusion reads
    # them now: views of its rows of the fused ones.
    @property
    def weight(self) -> torch.Tensor:
        return self._shared.weight[self._rows]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self._shared.bias
        return None if bias is None else bias[self._rows]

    @property
    def in_features(self) -> int:
        return self._shared.in_features

    @property
    def out_features(self) -> int:
        return self._shared.rows[self.index]

    @property
    def _rows(self) -> slice:
        start = sum(self._shared.rows[: self.index])
        return slice(start, start + self._shared.rows[self.index])
