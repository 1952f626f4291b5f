"""The one-token step's matmuls (Llama-3.2-1B's shapes, bf16, one row) as
cuBLAS runs them against a plain Triton GEMV, each timed as a decode step
sees it: replayed from a CUDA graph, the weights streamed from HBM (enough
copies to overflow L2), no launch gaps. A probe, not the benchmark: it
answers whether a GEMV pass (the decode method's `mm`s swapped for a
Triton kernel the package carries) would pay before one is built.

    python bench/gemv_probe.py      # a GPU: bench/results/gemv_probe_<gpu>.md

Prints, per shape, cuBLAS's time and read bandwidth, the best Triton
configuration found (rows per program, K per iteration, split-K, warps)
and the ratio, then the sum over one decode step of the 1B model's shapes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS, publish, table  # noqa: E402

# (name, out features N, in features K, per step): Llama-3.2-1B, q/k/v and gate/up fused as passes=llm fuses them.
SHAPES = [
    ("qkv", 3072, 2048, 16),
    ("o", 2048, 2048, 16),
    ("gate_up", 16384, 2048, 16),
    ("down", 2048, 8192, 16),
    ("lm_head", 128256, 2048, 1),
]
STREAMED_BYTES = 256 << 20  # each timed graph reads this much weight at least: several times an H100's 50 MB L2


@triton.jit
def gemv_kernel(
    w_ptr, x_ptr, y_ptr, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """y[n] = sum_k w[n, k] x[k], BLOCK_N rows a program, its K range in
    BLOCK_K steps, accumulated in fp32; with SPLIT_K > 1 the partial sums
    are added into a zeroed fp32 y."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = K // SPLIT_K
    start = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(start, start + span, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rows[:, None] < N, other=0.0)
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)
    else:
        tl.atomic_add(y_ptr + rows, y, mask=rows < N)


def triton_gemv(
    block_n: int, block_k: int, split_k: int, warps: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        y = (
            torch.zeros(n, device=w.device, dtype=torch.float32)
            if split_k > 1
            else torch.empty(n, device=w.device, dtype=w.dtype)
        )
        grid = (triton.cdiv(n, block_n), split_k)
        gemv_kernel[grid](w, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps)
        return y.to(w.dtype) if split_k > 1 else y

    return gemv


def streamed_copies(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Copies of a weight (`make` makes one), enough that a graph calling each once reads STREAMED_BYTES from HBM,
    not L2: two at least."""
    first = make()
    return [first] + [make() for _ in range(max(1, math.ceil(STREAMED_BYTES / first.nbytes) - 1))]


def streamed(n: int, k: int) -> list[torch.Tensor]:
    """`streamed_copies` of a random bf16 weight of N x K."""
    return streamed_copies(functools.partial(torch.randn, n, k, device="cuda", dtype=torch.bfloat16))


def cublas(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x[None], w)[0]


def replayed_us(call: Callable[..., object], weights: list[torch.Tensor], replays: int, *args: object) -> float:
    """Microseconds a call `call(w, *args)`, each reading the next copy of the weight, from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            call(w, *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w, *args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--block-n", type=int_list, default=[1, 2, 4, 8, 16])
    parser.add_argument("--block-k", type=int_list, default=[256, 512, 1024])
    parser.add_argument("--split-k", type=int_list, default=[1, 2, 4])
    parser.add_argument("--warps", type=int_list, default=[4, 8])
    args = parser.parse_args()
    configs = list(itertools.product(args.block_n, args.block_k, args.split_k, args.warps))
    gpu = torch.cuda.get_device_name()
    peak = {"H100": 3.35, "H200": 4.8}.get(next((g for g in ("H100", "H200") if g in gpu), ""), float("nan"))
    torch.manual_seed(0)
    rows, step = [], {"cuBLAS": 0.0, "Triton GEMV": 0.0}
    for name, n, k, per_step in SHAPES:
        size = n * k * 2
        weights = streamed(n, k)
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        reference = cublas(weights[0], x).float()
        base = replayed_us(cublas, weights, args.replays, x)
        best = (math.inf, None)
        for config in configs:
            if k % (config[1] * config[2]):
                continue
            gemv = triton_gemv(*config)
            if not torch.allclose(gemv(weights[0], x).float(), reference, rtol=2e-2, atol=2e-1):
                raise SystemExit(f"{name}: the Triton GEMV {config} disagrees with cuBLAS")
            best = min(best, (replayed_us(gemv, weights, args.replays, x), config), key=lambda b: b[0])
        rows.append([name, f"{n}x{k}", f"{size / 1e6:.1f}", f"{base:.2f}", f"{size / base / 1e6:.2f}", f"{best[0]:.2f}",
                     f"{size / best[0] / 1e6:.2f}", str(best[1]), f"{best[0] / base:.3f}"])  # fmt: skip
        step["cuBLAS"] += base * per_step
        step["Triton GEMV"] += best[0] * per_step
        print(rows[-1], flush=True)
        del weights
    step_bytes = sum(n * k * 2 * per_step for _, n, k, per_step in SHAPES)
    body = (
        f"{gpu} (peak {peak} TB/s), torch {torch.__version__}, triton {triton.__version__}; "
        f"best of {len(configs)} configurations (block_n, block_k, split_k, warps)\n\n"
        + table(
            ["shape", "N x K", "MB", "cuBLAS us", "TB/s", "Triton us", "TB/s", "config", "Triton / cuBLAS"],
            rows,
            "lrrrrrrlr",
        )
        + "\n\nOne decode step's matmuls (16 layers and the lm_head): "
        + ", ".join(f"{name} {us / 1000:.3f} ms" for name, us in step.items())
        + f"; the bandwidth floor of their {step_bytes / 1e9:.2f} GB: {step_bytes / peak / 1e9:.3f} ms\n"
    )
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    publish(
        RESULTS / f"gemv_probe_{tag}.md",
        "Decode matmuls: cuBLAS against a Triton GEMV",
        "python bench/gemv_probe.py " + " ".join(sys.argv[1:]),
        body,
    )


if __name__ == "__main__":
    main()
