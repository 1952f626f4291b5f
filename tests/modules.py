"""Modules that exist to exercise failure paths; importable as `modules.X`."""

from __future__ import annotations

import os

import torch
from torch import nn


class DataDependentBranch(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class RaisesInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("this constructor always fails")


class TwoInputs(nn.Module):
    """Positional and keyword inputs, two outputs in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.fc(x)
        return {"y": y, "scaled": y * scale}


class CountsCalls(nn.Module):
    """Python-side bookkeeping that must step aside while exporting."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import flashrt_build

        if not flashrt_build.is_exporting():
            self.calls += 1
        return self.fc(x)


class Stateful(nn.Module):
    """Updates a step counter and a running mean on every call, as a BatchNorm
    or a decoder cache would: a package must track them call after call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.fc(x) * self.steps + self.running_mean


class DiffersWhenExported(nn.Module):
    """Compiles a different function than it runs eagerly: verification must catch it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import flashrt_build

        return self.fc(x) + (0.5 if flashrt_build.is_exporting() else 0.0)


class RaisesInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(-1, 5))  # wrong for the configured [2, 4] input


class ReadsItsWeight(nn.Module):
    """Reads a Linear's weight outside the Linear, as some models do: fine in
    float, refused by a quantized weight (torchao implements no `abs`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.fc.weight.abs().mean()


class _WeightNormedLinear(nn.Linear):
    """Divides by its largest weight: reads the weight beyond the matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.weight.abs().amax()


class WeightNormedHead(nn.Module):
    """Its `head` works in float and fails once quantized, inside the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = _WeightNormedLinear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


_once_per_process_built = 0


class OncePerProcess(nn.Module):
    """Refuses a second construction in one process: a sweep whose jobs share
    a process (state leaking from one build into the next) fails with it."""

    def __init__(self, width: int = 8) -> None:
        global _once_per_process_built
        _once_per_process_built += 1
        if _once_per_process_built > 1:
            raise RuntimeError(f"constructed {_once_per_process_built} times in process {os.getpid()}")
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class WithBatchNorm(nn.Module):
    """BatchNorm in eval mode never reads its `num_batches_tracked` buffer (ResNet's case)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class BranchyMethod(nn.Module):
    """A forward that exports and a method that branches on a tensor's value:
    the build fails naming the method."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def branchy(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class FlagsAndConstants(nn.Module):
    """A forward with a flag fixed at build time (`module.kwargs`), a weight
    held in a transposed layout, and constant outputs beside the tensor:
    `(y, None, 3)`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mix", torch.randn(4, 4).t())  # strides (1, 4): not row-major

    def forward(self, x: torch.Tensor, negate: bool = False) -> tuple[torch.Tensor, None, int]:
        y = self.fc(x) @ self.mix
        return (-y if negate else y), None, 3


class AbortsWhenCompiled(nn.Module):
    """Eager reads in range; the compiled code indexes past its table (it sees
    `is_exporting()`), so the package aborts inside its own bounds check."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import flashrt_build

        return self.table(ids + (100 if flashrt_build.is_exporting() else 0))


class Vision(nn.Module):
    """A transformers-style forward: named inputs and **kwargs for the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, pixel_values: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return self.fc(pixel_values)


class RaisesInEval(nn.Module):
    """Its `train()` (which `eval()` calls) raises something flashrt_build does not anticipate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def train(self, mode: bool = True) -> RaisesInEval:
        raise LookupError("no such training mode")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@torch.library.custom_op("flashrt_tests::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """A custom operator with only a Python implementation, and a traceable one."""
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("flashrt_tests::nonzero_rows", mutates_args=())
def nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    """A Python-only custom operator whose implementation does not trace: it
    loops over values it reads back to the host, as transformers' grouped-mm
    fallback does."""
    return torch.stack([x[i] * int(x[i].sum().item() != 0) for i in range(x.shape[0])])


@nonzero_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CallsCustomOps(nn.Module):
    """A linear layer, then a custom operator: `twice` (decomposable) or
    `nonzero_rows` (not)."""

    def __init__(self, op: str = "twice") -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch.ops.flashrt_tests, self.op)(self.fc(x))


class PoolsRegions(nn.Module):
    """torchvision's roi_align: a custom operator with a C++ kernel, in torchvision's own library."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        import torchvision

        return torchvision.ops.roi_align(self.conv(images), [boxes], output_size=2)


class CallsCppOp(nn.Module):
    """A linear layer, then `flashrt_test_ops::scale`, a custom operator whose
    C++ kernel lives in a library of its own (cpp/tests/custom_op.cpp)."""

    def __init__(self, library: str) -> None:
        super().__init__()
        torch.ops.load_library(library)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.flashrt_test_ops.scale(self.fc(x), 3.0)


class _OwnForwardLinear(nn.Linear):
    """A Linear whose forward is its own: a fused matmul would not call it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1


class HookedProjections(nn.Module):
    """Two projections of one input (as attention's q and k are), the first
    one changed by `kind`: a forward hook doubling its output, a pre-hook
    counting its calls (`q_calls`), a subclass with its own forward, a
    forward set on the layer itself, a weight computed by a parametrization,
    or nothing ("none": fusable as it is); or the module reading k's tensors
    beside calling it ("reads_weight"), or writing into its input
    ("writes_input")."""

    def __init__(self, kind: str = "forward_hook", width: int = 8) -> None:
        super().__init__()
        self.q_proj = _OwnForwardLinear(width, width) if kind == "subclass" else nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        if kind == "forward_hook":
            self.q_proj.register_forward_hook(lambda layer, args, out: out * 2)
        elif kind == "pre_hook":
            self.q_calls = 0
            self.q_proj.register_forward_pre_hook(self._count)
        elif kind == "parametrized":
            torch.nn.utils.parametrize.register_parametrization(self.q_proj, "weight", _Doubled())
        elif kind == "instance_forward":
            plain = self.q_proj.forward
            self.q_proj.forward = lambda x: plain(x) * 5  # type: ignore[method-assign]
        elif kind not in ("none", "subclass", "reads_weight", "writes_input"):
            raise ValueError(f"unknown kind {kind!r}")
        self.kind = kind

    def _count(self, layer: nn.Module, args: tuple) -> None:
        self.q_calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.q_proj(x) * self.k_proj(x)
        if self.kind == "reads_weight":  # code that reads a projection's tensors beside calling it
            out = out + self.k_proj.weight.sum(dim=1) + self.k_proj.bias
        if self.kind == "writes_input":  # changes its input in place after reading it
            x.mul_(2)
        return out


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2
