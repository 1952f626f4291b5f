"""The `gemv` pass: a one-token step's matmuls as a Triton GEMV the package
carries, instead of cuBLAS's GEMM kernels.

At one row, a linear layer reads its whole weight to produce one output row:
a GEMV, bound by memory. cuBLAS runs it as a GEMM tile; a plain Triton GEMV
(two output rows a program, K in steps of 1024, fp32 sums) reads the same
bytes 8-25% faster on every Llama-3.2-1B decode shape on an H100
(bench/gemv_probe.py). The kernel is a `torch.library.triton_op`: export
keeps it as one operator, and AOTInductor compiles its Triton source into
the package, which loads and runs without Python like any other.

Float weights on a CUDA device take it, and int8 ones as torchao's
`Int8WeightOnlyConfig` makes them (int8 rows, one fp32 scale a row: the
kernel reads the int8 bytes and scales each row's sum, where Inductor's
code for them ran a reduction kernel of its own a layer). Only while
exporting (the eager reference that verifies the package keeps its own
matmul), and only where the call has one row (a static decode step); every
other call of the layer (prefill, a batch) stays `linear`.

The same kernel, with a prologue on its input and a residual added to its
output, is `flashrt::gemv_fused`: the `gemv_fusion` pass (gemv_fusion.py)
calls it in the exported graph where a GEMV's neighbours can join it.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.spec import BuildSpec
from .exporting import is_exporting
from .pdl import pdl_kernels
from .quantize import members

# (rows a program, K step, warps): the best configuration for every shape the probes timed
# (bench/gemv_probe.py; figures in BENCHMARKS.md)
LAUNCH = (2, 1024, 4)
# Weights loaded evict-first (read once a step: L2 is left to x), without software pipelining
EVICT, STAGES = True, 1
# int8 rows: bf16's K step and warps, twice its rows a program (as many bytes a program a step)
INT8_LAUNCH = (4, 1024, 4)
# int8 rows widened to fp32 through fp32's bits, not the conversion instruction (triton_kernels.widened)
INT8_BITS = True
# Weight tiles a program loads before it waits on the kernel before it (pdl): one; two timed the same
PREFETCH = 1
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INT8_WO = "Int8WeightOnlyConfig"  # the torchao config whose weights the kernel reads as they are (no args: per row)
NONE, NORM, GATED = 0, 1, 2  # the kernel's prologue on x: none, RMSNorm(x) * v, SiLU(x) * v (gemv_fusion.py)


def launch_rows(n: int, block_n: int, glu: bool) -> tuple[int, int]:
    """(output rows, rows a program) of a weight of `n` rows at `block_n`:
    with `glu` half of each, a program's rows being gate's and up's."""
    return (n // 2, max(1, block_n // 2)) if glu else (n, block_n)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    v: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0, prologue: int = NONE,
    glu: bool = False, scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    import triton
    from torch.library import wrap_triton

    from .triton_kernels import flashrt_pdl_gemv

    n, k = weight.shape
    block_n, block_k, warps = LAUNCH if scale is None else INT8_LAUNCH
    n, block_n = launch_rows(n, block_n, glu)
    block_k = min(block_k, triton.next_power_of_2(k))
    out = x.new_empty((*x.shape[:-1], n))  # x's dtype: an int8 weight's output is the activations'
    x = x.contiguous()
    wrap_triton(flashrt_pdl_gemv)[(triton.cdiv(n, block_n),)](
        weight, x, x if v is None else v.contiguous(), weight if bias is None else bias,
        out if residual is None else residual.contiguous(), out, out if scale is None else scale.contiguous(), n, k,
        eps, PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None, EVICT=EVICT, PDL=pdl_kernels(x), BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu,
        PREFETCH=PREFETCH, INT8_BITS=INT8_BITS, num_warps=warps, num_stages=STAGES,
    )  # fmt: skip
    return out


@functools.cache
def gemv_op() -> Any:
    """`torch.ops.flashrt.gemv(x, weight, bias, scale=None)`: `linear` for an
    input of one row, defined on first use (it needs Triton); with `scale`
    the weight is int8, row n's weights `weight[n] * scale[n]`."""
    from torch.library import triton_op

    @triton_op("flashrt::gemv", mutates_args=())
    def gemv(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _launch(x, weight, bias, scale=scale)

    return torch.ops.flashrt.gemv.default


@functools.cache
def gemv_fused_op() -> Any:
    """`torch.ops.flashrt.gemv_fused(x, weight, bias, v, residual, eps,
    prologue, glu=False, scale=None)`: the GEMV with its neighbours in one
    kernel (gemv_fusion.py): `linear(p(x), weight, bias) + residual`, p by
    `prologue` (NONE, NORM: RMSNorm(x) * v with `eps`, GATED: SiLU(x) * v);
    with `glu` the weight's rows are gate's then up's, and the kernel
    returns SiLU(gate) * up; `scale`: an int8 weight's, as `gemv`'s."""
    from torch.library import triton_op

    @triton_op("flashrt::gemv_fused", mutates_args=())
    def gemv_fused(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v: torch.Tensor | None,
        residual: torch.Tensor | None, eps: float, prologue: int, glu: bool = False, scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return _launch(x, weight, bias, v, residual, eps, prologue, glu, scale)

    return torch.ops.flashrt.gemv_fused.default


def gemv_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A CUDA layer's forward under the gemv pass: the GEMV for a one-row call while exporting, else `linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # Concrete one-row calls only: a symbolic row count (prefill's dynamic
    # prompt) stays a GEMM, which its other sizes need. (The device was
    # decided once, by `use_gemv`: only a CUDA layer gets this forward.)
    if is_exporting() and type(rows) is int and rows == 1:
        weight = layer.weight  # a quantized one is built anew from its parts at each read
        if (int8 := int8_rows(weight)) is not None:
            return gemv_op()(x, int8[0], layer.bias, int8[1])
        if not is_traceable_wrapper_subclass(weight):  # float
            return gemv_op()(x, weight, layer.bias)
    return nn.functional.linear(x, layer.weight, layer.bias)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 rows, their scales) of torchao's int8 weight-only tensor with a
    scale a row, whose linear is `x @ rows.T * scales` (zero points unused:
    symmetric); None for any other weight."""
    if not hasattr(weight, "qdata"):
        return None
    from torchao.quantization import Int8Tensor

    if not isinstance(weight, Int8Tensor) or weight.act_quant_kwargs is not None or weight.act_pre_scale is not None:
        return None
    n, k = weight.qdata.shape
    if list(weight.block_size) != [1, k] or weight.scale.numel() != n:
        return None
    return weight.qdata, weight.scale


def takes_gemv(name: str, layer: nn.Linear, spec: BuildSpec) -> bool:
    """Float weights, contiguous, that no `quant` rule quantizes or one
    quantizes with `Int8WeightOnlyConfig` as it is (a fused layer decided by
    its members' names, as the quantize stage decides it)."""
    return gemv_weights(name, layer, spec) is not None


def gemv_weights(name: str, layer: nn.Linear, spec: BuildSpec) -> str | None:
    """What the GEMV will read of the layer (`takes_gemv`): "float" or "int8" rows; None: it takes none."""
    weight = layer.weight
    if type(weight) is not nn.Parameter or weight.dtype not in FLOATS or not weight.is_contiguous():
        return None
    rule = spec.quant.rule_for(members(name, layer)[0]) if spec.quant is not None else None
    if rule is None or rule.keeps_float:
        return "float"
    return "int8" if rule.config == INT8_WO and not rule.args else None


def use_gemv(module: nn.Module, spec: BuildSpec) -> dict[str, str]:
    """Give the linear layers on a CUDA device that `takes_gemv` the GEMV for
    their one-row calls; what it reads of each ("float", "int8"), by FQN."""
    layers = {}
    for name, layer in module.named_modules():
        cuda = isinstance(layer, nn.Linear) and layer.weight.device.type == "cuda"
        if cuda and (reads := gemv_weights(name, layer, spec)) is not None:
            layer.forward = types.MethodType(gemv_forward, layer)  # this layer only
            layers[name] = reads
    return layers
