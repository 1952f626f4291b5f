"""Does widening bf16 to fp32 set the GEMV's pace? The shipped kernel's K
loop (bench/gemv_registers.py's SASS) spends about two instructions an
element widening bf16 weights: a byte permute to move the high half down,
then a multiply by 0x10000 to move it back up. Loaded as 32-bit words (two
bf16 each), the low element is the word shifted left 16 and the high one
the word with its low 16 bits cleared: one instruction an element. A plain
GEMV (y = W x, bf16, one row) in both forms:

    python bench/gemv_words_probe.py --sass    # no GPU: the K loop's SASS instructions a weight element, each form
    python bench/gemv_words_probe.py           # a GPU: both timed at decode shapes, against cuBLAS
                                               # (bench/results/gemv_words_probe_<gpu>.md)
    TRITON_INTERPRET=1 python bench/gemv_words_probe.py --check   # no GPU: both forms against torch

Measured on an H100 (bench/results/gemv_words_probe_h100.md): the same
within 1% (a step's matmuls 0.9245 ms by element, 0.9310 as words).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_probe import SHAPES, cublas, replayed_us, streamed  # noqa: E402
from report import RESULTS, publish, table  # noqa: E402

LAUNCHES = [(2, 1024, 4), (2, 2048, 4), (4, 1024, 4)]  # rows a program, K step (elements), warps; the first shipped


@triton.jit
def words_gemv(w_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """y[n] = sum_k w[n, k] x[k], bf16 w and x, BLOCK_N rows a program, K in
    BLOCK_K steps, fp32 sums; WORDS: w and x read as 32-bit words, each
    widened to two fp32 by a shift and a mask (a sum for each half)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if WORDS:
        w_words, x_words, half = w_ptr.to(tl.pointer_type(tl.int32)), x_ptr.to(tl.pointer_type(tl.int32)), K // 2
        low = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        high = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for k in range(0, half, BLOCK_K // 2):
            cols = k + tl.arange(0, BLOCK_K // 2)
            w = tl.load(w_words + rows[:, None] * half + cols[None, :], mask=rows[:, None] < N, other=0,
                        eviction_policy="evict_first")  # fmt: skip
            x = tl.load(x_words + cols)
            low += (w << 16).to(tl.float32, bitcast=True) * (x << 16).to(tl.float32, bitcast=True)[None, :]
            high += (w & -65536).to(tl.float32, bitcast=True) * (x & -65536).to(tl.float32, bitcast=True)[None, :]
        y = tl.sum(low + high, axis=1)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rows[:, None] < N, other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            acc += w.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(launch: tuple[int, int, int], words: bool, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W x at `launch` (K a multiple of its step: the decode shapes are)."""
    block_n, block_k, warps = launch
    y = torch.empty(w.shape[0], device=w.device, dtype=w.dtype)
    words_gemv[(triton.cdiv(w.shape[0], block_n),)](w, x, y, w.shape[0], w.shape[1], BLOCK_N=block_n,
                                                    BLOCK_K=block_k, WORDS=words, num_warps=warps)  # fmt: skip
    return y


def check() -> None:
    """Both forms against float64 torch, within a bf16 output rounding (Triton's interpreter, no GPU)."""
    torch.manual_seed(0)
    for n, k in [(7, 2048), (16, 1024)]:
        w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(k, dtype=torch.bfloat16)
        exact = w.double() @ x.double()
        for words in (False, True):
            err = ((gemv((2, 1024, 4), words, w, x).double() - exact).abs() / exact.abs().clamp(min=1)).max()
            assert err <= 2.0**-7, (n, k, words, err.item())
    print("ok")


def sass() -> None:
    """Each form's K loop in SASS (sm_90a, compiled here), per weight element a thread sums."""
    import gemv_registers

    types = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32"}
    for launch in LAUNCHES:
        for words in (False, True):
            constexprs = {"BLOCK_N": launch[0], "BLOCK_K": launch[1], "WORDS": words}
            ptx = gemv_registers.sm90_ptx(words_gemv, types, constexprs, launch[2])
            registers, lines = gemv_registers.assembled(ptx)
            loop = gemv_registers.loop_instructions(lines)
            elements = launch[0] * launch[1] // (launch[2] * 32)  # weight elements a thread sums a K step
            form = "words" if words else "bf16"
            per = loop / elements
            print(f"{launch} {form}: {registers} registers, {loop} instructions a K step, {per:.2f} an element")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="both forms against torch (Triton's interpreter)")
    parser.add_argument("--sass", action="store_true", help="the K loop's SASS instructions, no GPU")
    args = parser.parse_args()
    if args.check or args.sass:
        return check() if args.check else sass()
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    rows, step = [], {"cuBLAS": 0.0} | {f"{launch} {form}": 0.0 for launch in LAUNCHES for form in ("bf16", "words")}
    for name, n, k, per_step in SHAPES:
        weights = streamed(n, k)
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        reference = cublas(weights[0], x).float()
        base = replayed_us(cublas, weights, args.replays, x)
        step["cuBLAS"] += base * per_step
        row = [name, f"{n}x{k}", f"{base:.2f}"]
        for launch in LAUNCHES:
            for words, form in ((False, "bf16"), (True, "words")):
                if not torch.allclose(gemv(launch, words, weights[0], x).float(), reference, rtol=2e-2, atol=2e-1):
                    raise SystemExit(f"{name}: the {form} GEMV at {launch} disagrees with cuBLAS")
                us = replayed_us(lambda w, x, launch=launch, words=words: gemv(launch, words, w, x), weights,
                                 args.replays, x)  # fmt: skip
                step[f"{launch} {form}"] += us * per_step
                row.append(f"{us:.2f}")
        rows.append(row)
        print(row, flush=True)
        del weights
    forms = [f"{launch} {form}" for launch in LAUNCHES for form in ("bf16", "words")]
    body = (
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; us a call, one row, bf16; "
        "launches (rows a program, K step, warps)\n\n"
        + table(["shape", "N x K", "cuBLAS", *forms], rows, "lrr" + "r" * len(forms))
        + "\n\nOne decode step's matmuls (16 layers and the lm_head), ms: "
        + ", ".join(f"{name} {us / 1000:.4f}" for name, us in step.items())
        + "\n"
    )
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    publish(RESULTS / f"gemv_words_probe_{tag}.md", "bf16 GEMV: widened by element or as 32-bit words",
            "python bench/gemv_words_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip


if __name__ == "__main__":
    main()
