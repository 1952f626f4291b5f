"""Can a GEMV over int8 rows read at the bandwidth if its loads go to shared
memory, not registers? The shipped kernel keeps each weight tile in
registers beside an fp32 product an element, so an SM holds about 16 KB of
int8 weight in flight against 36 KB of bf16 (bench/results/gemv_registers.md),
and int8 rows took 0.83x bf16's time where the bytes say 0.5x. Fewer
registers (folding), fewer instructions (words) and other launches did not
move it.

This kernel multiplies on tensor cores instead: W's BLOCK_N rows times x
as a BLOCK_K x 16 tile whose first column is x (the other fifteen are
masked, never loaded), a `tl.dot` whose loads Triton's pipeliner turns
into asynchronous copies to shared memory, `num_stages` deep: the bytes in
flight are bounded by shared memory (228 KB an SM), not registers. The
wasted columns cost tensor-core time a GEMV has spare (a decode step is
about 2.5 GFLOP). Split-K programs add their sums into a zeroed fp32 y.

    python bench/gemv_dot_probe.py     # a GPU: bench/results/gemv_dot_probe_<gpu>.md
    TRITON_INTERPRET=1 python bench/gemv_dot_probe.py --check    # no GPU: against torch

Measured on an H100 (bench/results/gemv_dot_probe_h100.md): slower than the
shipped kernel for bf16 and int8 rows (a step's matmuls 1.028 and 0.798 ms
against 0.922 and 0.636) and than tinygemm for int4 (0.980 against 0.509);
in the package's chain (bench/results/gemv_dot.patch) 1.9-3.5x. Alone, the
shipped int8 kernel reads a large weight near the bandwidth (the lm_head at
2.83 TB/s); at a layer's size a call's fixed cost is most of its time.

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
from gemv_probe import SHAPES, cublas, int_list, replayed_us, streamed, streamed_copies  # noqa: E402
from report import RESULTS, publish, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashrt_build.stages.gemv import EVICT, INT8_LAUNCH, LAUNCH, STAGES  # noqa: E402
from flashrt_build.stages.triton_kernels import widened  # noqa: E402

Config = tuple[int, int, int, int]  # rows a program, K step, split-K, stages (4 warps)
GROUP = 128  # int4's columns a scale and zero (int4_wo's group size)
LAUNCHED: dict[tuple[Config, torch.dtype], object] = {}  # the compiled kernel at each config and weight type


@triton.jit
def dot_gemv(w_ptr, s_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
             HAS_SCALE: tl.constexpr, FP32: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """y[n] = sum_k w[n, k] x[k] (* s[n]: HAS_SCALE, w int8) on tensor cores:
    BLOCK_N rows a program, its share of K (SPLIT_K) in BLOCK_K steps, x a
    [BLOCK_K, 16] tile of which only column 0 is loaded (the rest are 0, so
    the row sums are W x). int8 widens through fp32's bits (the shipped
    kernel's `widened`); uint8 w is int4, two a byte (the even element the
    high nibble, as torchao packs them for tinygemm), w = (q - 8) * scale +
    zero by GROUP columns, s [N, K / GROUP, 2] bf16 (scale, zero). Then to
    the dot's type: bf16, or fp32 where FP32 (Triton's interpreter gets a
    bf16 dot wrong)."""
    dot_type: tl.constexpr = tl.float32 if FP32 else tl.bfloat16
    int4: tl.constexpr = w_ptr.dtype.element_ty == tl.uint8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = K // SPLIT_K
    start = tl.program_id(1) * span
    column = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(start, start + span, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks[:, None] + column[None, :] * 0, mask=column[None, :] == 0, other=0.0)
        if int4:
            w = int4_tile(w_ptr, s_ptr, rows, k, K, BLOCK_N, BLOCK_K, GROUP)
        else:
            w = tl.load(w_ptr + rows[:, None] * K + ks[None, :])
            if w.dtype == tl.int8:
                w = widened(w, True)
        acc = tl.dot(w.to(dot_type), x.to(dot_type), acc)
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    else:
        tl.atomic_add(y_ptr + rows, y)


@triton.jit
def int4_tile(w_ptr, s_ptr, rows, k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The fp32 weights of `rows` at K columns k.. k + BLOCK_K from int4 two a byte and a (scale, zero) a GROUP."""
    halves = k // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rows[:, None] * (K // 2) + halves[None, :])
    q = tl.join(packed >> 4, packed & 15).reshape(BLOCK_N, BLOCK_K).to(tl.int32)
    q = (q + 0x4B400000).to(tl.float32, bitcast=True) - 12582920.0  # q - 8, through fp32's bits
    groups = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
    at = s_ptr + (rows[:, None] * (K // GROUP) + groups[None, :]) * 2
    scale, zero = tl.load(at).to(tl.float32), tl.load(at + 1).to(tl.float32)
    w = q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) * scale[:, :, None] + zero[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K)


def columns(w: torch.Tensor) -> int:
    """K of a weight: int4 (uint8) holds two columns a byte."""
    return w.shape[1] * (2 if w.dtype == torch.uint8 else 1)


def dot(config: Config, fp32: bool = False) -> Callable[..., torch.Tensor]:
    """The tensor-core GEMV at `config`: call(w, x, s=None), s int8 rows' scales or int4's scales and zeros."""
    block_n, block_k, split_k, stages = config

    def call(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
        n, k = w.shape[0], columns(w)
        assert n % block_n == 0 and k % (block_k * split_k) == 0, (w.shape, config)
        y = torch.zeros(n, device=w.device) if split_k > 1 else torch.empty(n, device=w.device, dtype=x.dtype)
        grid, scaled = (n // block_n, split_k), s is not None and w.dtype == torch.int8
        LAUNCHED[config, w.dtype] = dot_gemv[grid](w, w if s is None else s, x, y, n, k, BLOCK_N=block_n,
                                                   BLOCK_K=block_k, SPLIT_K=split_k, HAS_SCALE=scaled, FP32=fp32,
                                                   GROUP=GROUP, num_warps=4, num_stages=stages)  # fmt: skip
        return y.to(x.dtype)

    return call


def int8_weights(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and one fp32 scale a row, as int8_wo's."""
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device), torch.rand(n, device=device) / 100


def int4_weights(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 two a byte and a (scale, zero) a GROUP of columns, bf16 [N, K / GROUP, 2], as int4_wo's (tinygemm's)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    return packed, (torch.randn(n, k // GROUP, 2, device=device) / 100).to(torch.bfloat16)


def dequantized(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """The fp32 weight an int8 (w, s) or int4 (packed w, scales and zeros s) pair stands for; bf16 w as it is."""
    if w.dtype == torch.int8:
        return w.float() * s[:, None]
    if w.dtype == torch.uint8:
        q = torch.stack([w >> 4, w & 15], -1).reshape(w.shape[0], -1).float() - 8
        n, groups = s.shape[:2]
        return (q.reshape(n, groups, GROUP) * s[..., :1].float() + s[..., 1:].float()).reshape(n, -1)
    return w.float()


def tinygemm(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """int4_wo's matmul as torchao runs it on a GPU (w packed by `_convert_weight_to_int4pack`, s [K / GROUP, N, 2])."""
    return torch.ops.aten._weight_int4pack_mm(x[None], w, GROUP, s)[0]


def check() -> None:
    """Each weight kind, split and not, against float64 torch (Triton's interpreter, no GPU)."""
    torch.manual_seed(0)
    x = torch.randn(512, dtype=torch.bfloat16)
    kinds = [(torch.randn(64, 512, dtype=torch.bfloat16), None), int8_weights(64, 512, "cpu"),
             int4_weights(64, 512, "cpu")]  # fmt: skip
    for config in [(16, 128, 1, 2), (32, 256, 2, 3)]:
        for w, s in kinds:
            exact = dequantized(w, s).double() @ x.double()
            got = dot(config, fp32=True)(w, x, s).double()
            err = ((got - exact).abs() / exact.abs().clamp(min=1)).max().item()
            assert err <= 2.0**-7, (config, w.dtype, err)
    print("ok")


def best(calls: dict[Config, Callable], weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor | None,
         reference: torch.Tensor, replays: int) -> tuple[float, Config | None]:  # fmt: skip
    """The fastest of `calls` that agrees with `reference` (one that cannot compile or launch, as out of shared
    memory, skipped: the log names it)."""
    found: tuple[float, Config | None] = (math.inf, None)
    n, k = weights[0].shape[0], columns(weights[0])
    for config, call in calls.items():
        if n % config[0] or k % (config[1] * config[2]) or (weights[0].dtype == torch.uint8 and config[1] % GROUP):
            continue
        try:
            out = call(weights[0], x, s)
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as error:
            print(f"{config} {weights[0].dtype}: skipped, {type(error).__name__}", flush=True)
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


def timed(n: int, k: int, calls: dict[Config, Callable], replays: int) -> tuple[dict[str, tuple], bool]:
    """Each form's microseconds a call at N x K (the tensor-core forms' best config beside it), and whether
    tinygemm reads the int4 bytes as this probe does."""
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    bf16 = streamed(n, k)
    int8, s8 = streamed_copies(lambda: int8_weights(n, k, "cuda")[0]), int8_weights(n, k, "cuda")[1]
    int4, s4 = streamed_copies(lambda: int4_weights(n, k, "cuda")[0]), int4_weights(n, k, "cuda")[1]
    packed = [torch.ops.aten._convert_weight_to_int4pack(w, 8) for w in int4]  # int4_wo's inner K tiles
    s4_tiny = s4.transpose(0, 1).contiguous()
    ref8, ref4 = dequantized(int8[0], s8) @ x.float(), dequantized(int4[0], s4) @ x.float()
    agrees = torch.allclose(tinygemm(packed[0], x, s4_tiny).float(), ref4, rtol=2e-2, atol=2e-1)
    bf16_shipped, int8_shipped = shipped_gemv((*LAUNCH, STAGES, EVICT)), shipped_gemv((*INT8_LAUNCH, STAGES, EVICT))
    us = {
        "cuBLAS bf16": (replayed_us(cublas, bf16, replays, x), None),
        "shipped bf16": (replayed_us(bf16_shipped, bf16, replays, x), LAUNCH),
        "tensor cores bf16": best(calls, bf16, x, None, cublas(bf16[0], x).float(), replays),
        "shipped int8": (replayed_us(lambda w, x: int8_shipped(w, x, s=s8), int8, replays, x), INT8_LAUNCH),
        "tensor cores int8": best(calls, int8, x, s8, ref8, replays),
        "tinygemm int4": (replayed_us(lambda w, x: tinygemm(w, x, s4_tiny), packed, replays, x), None),
        "tensor cores int4": best(calls, int4, x, s4, ref4, replays),
    }
    return us, agrees


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
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    forms = ["cuBLAS bf16", "shipped bf16", "tensor cores bf16", "shipped int8", "tensor cores int8", "tinygemm int4",
             "tensor cores int4"]  # fmt: skip
    rows, step, notes = [], dict.fromkeys(forms, 0.0), []
    for name, n, k, per_step in SHAPES:
        us, agrees = timed(n, k, calls, args.replays)
        if not agrees:
            notes.append(f"{name}: tinygemm's output is not this probe's reading of the int4 bytes (its time stands)")
        for form in forms:
            step[form] += us[form][0] * per_step
        kinds = (("bf16", torch.bfloat16), ("int8", torch.int8), ("int4", torch.uint8))
        rows.append([name, f"{n}x{k}"] + [f"{us[f][0]:.2f} {us[f][1] or ''}".strip() for f in forms]
                    + [resources(us[f"tensor cores {kind}"][1], dtype) for kind, dtype in kinds])  # fmt: skip
        print(rows[-1], flush=True)
    body = (
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; us a call, one row, weights streamed "
        f"from HBM; shipped: flashrt_pdl_gemv at gemv.LAUNCH / INT8_LAUNCH (rows, K step, warps), without PDL; "
        f"tensor cores: the best of {len(configs)} (rows, K step, split-K, stages), 4 warps\n\n"
        + table(
            ["shape", "N x K", *forms, *(f"{kind} registers, shared KB" for kind in ("bf16", "int8", "int4"))],
            rows,
            "ll" + "l" * len(forms) + "rrr",
        )  # fmt: skip
        + "\n\nOne decode step's matmuls (16 layers and the lm_head), ms: "
        + ", ".join(f"{form} {total / 1000:.4f}" for form, total in step.items())
        + "\n"
        + "".join(f"\n{note}\n" for note in notes)
    )
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    publish(RESULTS / f"gemv_dot_probe_{tag}.md", "GEMV on tensor cores, loads pipelined through shared memory",
            "python bench/gemv_dot_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip


if __name__ == "__main__":
    main()
