"""Verification's comparison of one large output: slice by slice (every value
finite) against the whole-tensor comparison (the one a non-finite value
takes, and every output took before), side by side.

    .venv/bin/python bench/compare_leaf.py [--shape 1,4096,49152] [--rounds 3]

The default shape is a causal LM's prefill logits at a 4096-token prompt
(SmolLM2-135M's vocabulary, float32: 805 MB). Figures: bench/results/compare_leaf.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from report import RESULTS, alternate, publish, table

from flashrt_build.stages.compare import compare_leaves


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,4096,49152")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = [int(n) for n in args.shape.split(",")]
    ref = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = ref + 1e-6 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ref_nan, out_nan = ref.clone(), out.clone()
    ref_nan.view(-1)[0] = out_nan.view(-1)[0] = float("nan")  # the same NaN in both: compared whole

    def timed(o: torch.Tensor, r: torch.Tensor) -> float:
        start = time.perf_counter()
        assert compare_leaves([o], r, None, None)[0].passed
        return time.perf_counter() - start

    times = alternate({"slice by slice (all finite)": lambda: timed(out, ref),
                       "whole (a NaN in both)": lambda: timed(out_nan, ref_nan)}, args.rounds)  # fmt: skip
    med = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(med))
    rows = [[name, f"{m:.2f}", f"{min(times[name]):.2f}", f"{m / med[first]:.1f}x"] for name, m in med.items()]
    size = ref.numel() * ref.element_size() / 1e6
    header = ["comparison", "median", "min", "/ slices"]
    text = (f"One float32 leaf of shape {shape} ({size:.0f} MB), {torch.get_num_threads()} threads, "
            f"{args.rounds} alternating rounds; seconds\n\n{table(header, rows)}")  # fmt: skip
    command = f"python bench/compare_leaf.py --shape {args.shape} --rounds {args.rounds}"
    publish(RESULTS / "compare_leaf.md", "Comparing one large output", command, text)
    print(text)


if __name__ == "__main__":
    main()
