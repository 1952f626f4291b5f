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

from report import RESULTS, alternate, publish, table  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.config.compose import compose  # noqa: E402
from flashrt_build.config.spec import resolve_spec  # noqa: E402
from flashrt_build.stages.inputs import make_inputs  # noqa: E402


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
    parser.add_argument("--out", type=Path, default=RESULTS / "call_overhead.md")
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
        with torch.no_grad():
            for fn in variants.values():
                per_call_us(fn, 1000)  # warm-up
            rounds = alternate(
                {n: lambda fn=fn: per_call_us(fn, args.calls) for n, fn in variants.items()}, args.rounds
            )
    median = {name: statistics.median(values) for name, values in rounds.items()}
    bare = median["boxed_run (no checks)"]
    rows = [
        [name, f"{median[name]:.1f}", ", ".join(f"{v:.1f}" for v in values), f"{median[name] - bare:+.1f}"]
        for name, values in rounds.items()
    ]
    header = [
        f"call ({args.module}, CPU, torch {torch.__version__})",
        "us per call, median",
        "rounds",
        "over boxed_run",
    ]
    command = f".venv/bin/python bench/call_overhead.py --module {args.module} --rounds {args.rounds}"
    publish(args.out, "Per-call cost of a loaded package", command, table(header, rows, align="lrlr"))


if __name__ == "__main__":
    main()
