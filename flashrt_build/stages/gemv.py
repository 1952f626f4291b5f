"""The `gemv` pass: a one-token step's matmuls as a Triton GEMV the package
carries, instead of cuBLAS's GEMM kernels.

At one row, a linear layer reads its whole weight to produce one output row:
a GEMV, bound by memory. cuBLAS runs it as a GEMM tile; a plain Triton GEMV
(two output rows a program, K in steps of 1024, fp32 sums) reads the same
bytes 8-25% faster on every Llama-3.2-1B decode shape on an H100
(bench/gemv_probe.py). The kernel is a `torch.library.triton_op`: export
keeps it as one operator, and AOTInductor compiles its Triton source into
the package, which loads and runs without Python like any other.

Only float weights on a CUDA device take it, only while exporting (the eager
reference that verifies the package keeps cuBLAS's matmul), and only where
the call has one row (a static decode step); every other call of the layer
(prefill, a batch) stays `linear`.

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

from ..config.spec import BuildSpec
from .exporting import is_exporting
from .pdl import pdl_kernels
from .quantize import members

BLOCK_N, BLOCK_K, WARPS = 2, 1024, 4  # the best of 72 configurations for every shape (bench/results/gemv_probe_h100.md)
# Weights loaded evict-first (read once a step: L2 is left to x) without software pipelining: 2-4% off
# every shape against Triton's default 3 stages (bench/results/gemv_fusion_probe_h100.md)
EVICT, STAGES = True, 1
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
NONE, NORM, GATED = 0, 1, 2  # the kernel's prologue on x: none, RMSNorm(x) * v, SiLU(x) * v (gemv_fusion.py)


@functools.cache
def kernel() -> Any:
    """The GEMV's Triton kernel, made on first use (it needs Triton); its ops
    launch it, and so does bench/gemv_fusion_probe.py."""
    import triton
    import triton.language as tl

    @triton.jit
    def flashrt_pdl_gemv(
        w_ptr, x_ptr, v_ptr, b_ptr, r_ptr, y_ptr, N, K, eps,
        PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """y[n] = sum_k w[n, k] p(x)[k] (+ b[n]) (+ r[n]): BLOCK_N rows a
        program, K in BLOCK_K steps, summed in fp32. The prologue p: x as
        it is, RMSNorm(x) * v (each program sums x^2 over the K it reads
        anyway and scales its sums once at the end), or SiLU(x) * v. EVICT
        loads the weight evict-first.

        The first weight tile is loaded before the program waits on the
        kernel before it (PDL: in a package the pdl pass launches as a
        programmatic dependent): the weights do not depend on the step, so
        they stream in while that kernel finishes."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        evict: tl.constexpr = "evict_first" if EVICT else ""
        w_rows, w_in, cols = w_ptr + rows[:, None] * K, rows[:, None] < N, tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :], mask=w_in & (cols[None, :] < K), other=0.0, eviction_policy=evict)
        # what the step wrote (x, the residual) and its output only through pointers offset by `ready`: after the wait
        ready = 0
        if PDL:  # pure (torch's mutation analysis skips it), a value (what uses it stays after it); x16: aligned
            ready = tl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;",
                                              "=r", [], dtype=tl.int32, is_pure=True, pack=1) * 16  # fmt: skip
        x_ptr, r_ptr, y_ptr = x_ptr + ready, r_ptr + ready, y_ptr + ready
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            if k > 0:  # the first tile is in
                w = tl.load(w_rows + cols[None, :], mask=w_in & (cols[None, :] < K), other=0.0, eviction_policy=evict)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if PROLOGUE == 1:
                squares += x * x
                x = x * tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            elif PROLOGUE == 2:
                x = x * tl.sigmoid(x) * tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if PROLOGUE == 1:  # eps arrives as fp64 from AOTInductor: the scale stays fp32
            y = y * tl.rsqrt((tl.sum(squares, axis=0) / K + eps).to(tl.float32))
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            y += tl.load(r_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)

    return flashrt_pdl_gemv


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    v: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0, prologue: int = NONE,
) -> torch.Tensor:  # fmt: skip
    import triton
    from torch.library import wrap_triton

    n, k = weight.shape
    out = x.new_empty((*x.shape[:-1], n))
    x = x.contiguous()
    wrap_triton(kernel())[(triton.cdiv(n, BLOCK_N),)](
        weight, x, x if v is None else v.contiguous(), weight if bias is None else bias,
        out if residual is None else residual.contiguous(), out, n, k, eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, EVICT=EVICT,
        PDL=pdl_kernels(x), BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)),
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out


@functools.cache
def gemv_op() -> Any:
    """`torch.ops.flashrt.gemv(x, weight, bias)`: `linear` for an input of one
    row, defined on first use (it needs Triton)."""
    from torch.library import triton_op

    @triton_op("flashrt::gemv", mutates_args=())
    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _launch(x, weight, bias)

    return torch.ops.flashrt.gemv.default


@functools.cache
def gemv_fused_op() -> Any:
    """`torch.ops.flashrt.gemv_fused(x, weight, bias, v, residual, eps,
    prologue)`: the GEMV with its neighbours in one kernel (gemv_fusion.py):
    `linear(p(x), weight, bias) + residual`, p by `prologue` (NONE, NORM:
    RMSNorm(x) * v with `eps`, GATED: SiLU(x) * v)."""
    from torch.library import triton_op

    @triton_op("flashrt::gemv_fused", mutates_args=())
    def gemv_fused(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v: torch.Tensor | None,
        residual: torch.Tensor | None, eps: float, prologue: int,
    ) -> torch.Tensor:  # fmt: skip
        return _launch(x, weight, bias, v, residual, eps, prologue)

    return torch.ops.flashrt.gemv_fused.default


def gemv_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A CUDA layer's forward under the gemv pass: the GEMV for a one-row call while exporting, else `linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # Concrete one-row calls only: a symbolic row count (prefill's dynamic
    # prompt) stays a GEMM, which its other sizes need. (The device was
    # decided once, by `use_gemv`: only a CUDA layer gets this forward.)
    if is_exporting() and type(rows) is int and rows == 1:
        return gemv_op()(x, layer.weight, layer.bias)
    return nn.functional.linear(x, layer.weight, layer.bias)


def takes_gemv(name: str, layer: nn.Linear, spec: BuildSpec) -> bool:
    """Float weights, contiguous, that no `quant` rule quantizes (a fused
    layer decided by its members' names, as the quantize stage decides it)."""
    weight = layer.weight
    if type(weight) is not nn.Parameter or weight.dtype not in FLOATS or not weight.is_contiguous():
        return False
    rule = spec.quant.rule_for(members(name, layer)[0]) if spec.quant is not None else None
    return rule is None or rule.keeps_float


def use_gemv(module: nn.Module, spec: BuildSpec) -> list[str]:
    """Give the linear layers on a CUDA device that `takes_gemv` the GEMV for
    their one-row calls; their FQNs."""
    layers = []
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear) and layer.weight.device.type == "cuda" and takes_gemv(name, layer, spec):
            layer.forward = types.MethodType(gemv_forward, layer)  # type: ignore[method-assign]  # this layer only
            layers.append(name)
    return layers
