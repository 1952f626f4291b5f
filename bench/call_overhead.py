"""Per-call cost of a loaded package on the host: torch's runner, the
package's bare entry point, and `flashrt_build.load`'s module, side by side.

    .venv/bin/python bench/call_overhead.py [--module mlp] [--rounds 5] [--calls 20000]

Builds the module once (CPU), loads the package three ways and times them
alternately in one process: `aoti_load_package(...)(**inputs)` (torch's
AOTICompiledModel: parses its call spec and flattens the inputs per call), its
`loader.boxed_run([...])` (the compiled code alone, no checks), and
`flashrt_build.load(dir)(**inputs)` (input checks included). Microseconds per
call: the median over rounds, and each module's overhead over `boxed_run`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import flashrt_build  # noqa: E402
from flashrt_build.config import compose  # noqa: E402
from flashrt_build.inputs import make_inputs  # noqa: E402
from flashrt_build.spec import resolve_spec  # noqa: E402


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", default="mlp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "call_overhead.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        cfg = compose([f"+module={args.module}", f"output_root={root}"])
        result = flashrt_build.build(cfg)
        spec = resolve_spec(cfg)
        example = make_inputs(spec)
        tensors = [a for a in example.args] + [v for v in example.kwargs.values() if isinstance(v, torch.Tensor)]
        runner = torch._inductor.aoti_load_package(str(result.package))
        loaded = flashrt_build.load(result.output_dir)
        variants = {
            "torch AOTICompiledModel": lambda: runner(*example.args, **example.kwargs),
            "boxed_run (no checks)": lambda: runner.loader.boxed_run(list(tensors)),
            "flashrt_build.load": lambda: loaded(*example.args, **example.kwargs),
        }
        rounds: dict[str, list[float]] = {name: [] for name in variants}
        with torch.no_grad():
            for fn in variants.values():
                per_call_us(fn, 1000)  # warm-up
            for r in range(args.rounds):
                order = list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
                for name in order:
                    rounds[name].append(per_call_us(variants[name], args.calls))
    median = {name: statistics.median(values) for name, values in rounds.items()}
    bare = median["boxed_run (no checks)"]
    lines = [
        f"| call ({args.module}, CPU, torch {torch.__version__}) | us per call, median | rounds | over boxed_run |",
        "|---|---:|---|---:|",
    ]
    for name, values in rounds.items():
        spread = ", ".join(f"{v:.1f}" for v in values)
        lines.append(f"| {name} | {median[name]:.1f} | {spread} | {median[name] - bare:+.1f} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
