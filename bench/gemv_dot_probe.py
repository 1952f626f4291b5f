"""Can a GEMV over int8 rows read at the bandwidth if its loads go to shared
memory, not registers? The shipped kernel keeps each weight tile in
registers beside an fp32 product an element, so an SM holds about 16 KB of
int8 weight in flight against 36 KB of bf16 (bench/results/gemv_registers.md)
and int8 rows stream at about bf16's elements a second, not its bytes
(0.83x bf16's time where the bytes say 0.5x). Fewer registers (folding),
fewer instructions (words) and other launches did not move it.

This kernel multiplies on tensor cores instead: W's BLOCK_N rows times x
as a BLOCK_K x 16 tile whose first column is x (the other fifteen are
masked, never loaded), a `tl.dot` whose loads Triton's pipeliner turns
into asynchronous copies to shared memory, `num_stages` deep: the bytes in
flight are bounded by shared memory (228 KB an SM), not registers. The
wasted columns cost tensor-core time a GEMV has spare (a decode step is
about 2.5 GFLOP). Split-K programs add their sums into a zeroed fp32 y.

    python bench/gemv_dot_probe.py     # a GPU: bench/results/gemv_dot_probe_<gpu>.md
    TRITON_INTERPRET=1 python bench/gemv_dot_probe.py --check    # no GPU: against torch

Prints, per decode shape (Llama-3.2-1B), cuBLAS (bf16), the shipped kernel
on bf16 and on int8 rows at their launches, and the best tensor-core
configuration on each (rows a program, K step, split-K, stages), then one
decode step's matmuls summed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_fusion_probe import gemv as shipped_gemv  # noqa: E402
from gemv_probe import SHAPES, STREAMED_BYTES, cublas, int_list, replayed_us  # noqa: E402
from report import RESULTS, publish, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashrt_build.stages.gemv import EVICT, INT8_LAUNCH, LAUNCH, STAGES  # noqa: E402

Config = tuple[int, int, int, int]  # rows a program, K step, split-K, stages (4 warps)
LAUNCHED: dict[tuple[Config, torch.dtype], object] = {}  # the compiled kernel at each config and weight type


@triton.jit
def dot_gemv(w_ptr, s_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
             HAS_SCALE: tl.constexpr, FP32: tl.constexpr):  # fmt: skip
    """y[n] = sum_k w[n, k] x[k] (* s[n]: HAS_SCALE, w int8) on tensor cores:
    BLOCK_N rows a program, its share of K (SPLIT_K) in BLOCK_K steps, x a
    [BLOCK_K, 16] tile of which only column 0 is loaded (the rest are 0, so
    the row sums are W x). int8 widens through fp32's bits (as the shipped
    kernel's `widened`), then to the dot's type: bf16, or fp32 where FP32
    (Triton's interpreter gets a bf16 dot wrong)."""
    dot_type: tl.constexpr = tl.float32 if FP32 else tl.bfloat16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = K // SPLIT_K
    start = tl.program_id(1) * span
    column = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(start, start + span, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :])
        x = tl.load(x_ptr + ks[:, None] + column[None, :] * 0, mask=column[None, :] == 0, other=0.0)
        if w.dtype == tl.int8:
            w = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        acc = tl.dot(w.to(dot_type), x.to(dot_type), acc)
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    else:
        tl.atomic_add(y_ptr + rows, y)


def dot(config: Config, fp32: bool = False) -> Callable[..., torch.Tensor]:
    """The tensor-core GEMV at `config`: call(w, x, s=None), s int8 rows' scales."""
    block_n, block_k, split_k, stages = config

    def call(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
        n, k = w.shape
        assert n % block_n == 0 and k % (block_k * split_k) == 0, (w.shape, config)
        y = torch.zeros(n, device=w.device) if split_k > 1 else torch.empty(n, device=w.device, dtype=x.dtype)
        grid = (n // block_n, split_k)
        LAUNCHED[config, w.dtype] = dot_gemv[grid](w, w if s is None else s, x, y, n, k, BLOCK_N=block_n,
                                                   BLOCK_K=block_k, SPLIT_K=split_k, HAS_SCALE=s is not None,
                                                   FP32=fp32, num_warps=4, num_stages=stages)  # fmt: skip
        return y.to(x.dtype)

    return call


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as int8_wo quantizes it: int8 rows and one fp32 scale a row."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / 127
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def check() -> None:
    """Both weight kinds, split and not, against float64 torch (Triton's interpreter, no GPU)."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 512, dtype=torch.bfloat16), torch.randn(512, dtype=torch.bfloat16)
    q, s = int8_rows(w)
    for config in [(16, 128, 1, 2), (32, 64, 2, 3)]:
        for weights, scale, exact in ((w, None, w.double() @ x.double()),
                                      (q, s, (q.double() @ x.double()) * s.double())):  # fmt: skip
            got = dot(config, fp32=True)(weights, x, scale).double()
            err = ((got - exact).abs() / exact.abs().clamp(min=1)).max().item()
            assert err <= 2.0**-7, (config, weights.dtype, err)
    print("ok")


def best(calls: dict[Config, Callable], weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor | None,
         reference: torch.Tensor, replays: int) -> tuple[float, Config | None]:  # fmt: skip
    """The fastest of `calls` that agrees with `reference` (one that cannot launch, out of shared memory, skipped)."""
    found: tuple[float, Config | None] = (math.inf, None)
    for config, call in calls.items():
        n, k = weights[0].shape
        if n % config[0] or k % (config[1] * config[2]):
            continue
        try:
            out = call(weights[0], x, s)
        except triton.runtime.errors.OutOfResources:
            continue
        if not torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-1):
            raise SystemExit(f"the tensor-core GEMV at {config} ({weights[0].dtype}) disagrees with the reference")
        us = replayed_us(lambda w, x, call=call: call(w, x, s), weights, replays, x)
        found = min(found, (us, config), key=lambda b: b[0])
    return found


def resources(config: Config | None, dtype: torch.dtype) -> str:
    """Registers a thread and shared memory a program of the kernel at `config`: they bound the bytes in flight."""
    kernel = LAUNCHED.get((config, dtype)) if config else None
    if kernel is None:
        return ""
    return f"{getattr(kernel, 'n_regs', '?')}, {getattr(kernel.metadata, 'shared', 0) // 1024}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="against torch in Triton's interpreter, no GPU")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--block-n", type=int_list, default=[16, 32, 64])
    parser.add_argument("--block-k", type=int_list, default=[128, 256, 512])
    parser.add_argument("--split-k", type=int_list, default=[1, 2, 4])
    parser.add_argument("--stages", type=int_list, default=[3, 5])
    args = parser.parse_args()
    if args.check:
        return check()
    configs = list(itertools.product(args.block_n, args.block_k, args.split_k, args.stages))
    calls = {config: dot(config) for config in configs}
    bf16_shipped = shipped_gemv((*LAUNCH, STAGES, EVICT))
    int8_shipped = shipped_gemv((*INT8_LAUNCH, STAGES, EVICT))
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    forms = ["cuBLAS bf16", "shipped bf16", "tensor cores bf16", "shipped int8", "tensor cores int8"]
    rows, step = [], dict.fromkeys(forms, 0.0)
    for name, n, k, per_step in SHAPES:
        copies = max(2, math.ceil(STREAMED_BYTES / (n * k)))  # int8's bytes: bf16 streams twice as much
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        quantized = [int8_rows(w) for w in weights]
        int8, scale = [q for q, _ in quantized], quantized[0][1]
        bf16_reference = cublas(weights[0], x).float()
        int8_reference = (int8[0].float() @ x.float()) * scale
        us = {
            "cuBLAS bf16": (replayed_us(cublas, weights, args.replays, x), None),
            "shipped bf16": (replayed_us(bf16_shipped, weights, args.replays, x), LAUNCH),
            "tensor cores bf16": best(calls, weights, x, None, bf16_reference, args.replays),
            "shipped int8": (
                replayed_us(lambda w, x, scale=scale: int8_shipped(w, x, s=scale), int8, args.replays, x),
                INT8_LAUNCH,
            ),  # fmt: skip
            "tensor cores int8": best(calls, int8, x, scale, int8_reference, args.replays),
        }
        for form in forms:
            step[form] += us[form][0] * per_step
        rows.append([name, f"{n}x{k}"] + [f"{us[f][0]:.2f} {us[f][1] or ''}".strip() for f in forms]
                    + [resources(us["tensor cores bf16"][1], torch.bfloat16),
                       resources(us["tensor cores int8"][1], torch.int8)])  # fmt: skip
        print(rows[-1], flush=True)
        del weights, int8, quantized
    body = (
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; us a call, one row, weights streamed "
        f"from HBM; shipped: flashrt_pdl_gemv at gemv.LAUNCH / INT8_LAUNCH (rows, K step, warps), without PDL; "
        f"tensor cores: the best of {len(configs)} (rows, K step, split-K, stages), 4 warps\n\n"
        + table(
            ["shape", "N x K", *forms, "bf16 registers, shared KB", "int8 registers, shared KB"],
            rows,
            "ll" + "l" * len(forms) + "rr",
        )  # fmt: skip
        + "\n\nOne decode step's matmuls (16 layers and the lm_head), ms: "
        + ", ".join(f"{form} {total / 1000:.4f}" for form, total in step.items())
        + "\n"
    )
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    publish(RESULTS / f"gemv_dot_probe_{tag}.md", "GEMV on tensor cores, loads pipelined through shared memory",
            "python bench/gemv_dot_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip


if __name__ == "__main__":
    main()
