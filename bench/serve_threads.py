"""A CPU package's decode step on 1 thread, on all cores, and on `generate`'s
default (the cores other work leaves idle), with the machine otherwise idle
and with busy processes beside it, side by side.

    .venv/bin/python bench/serve_threads.py [--busy 0,1,2] [--rounds 5] [--steps 64] [--work DIR]

Builds a tiny Llama (`causal_lm`, tests/llm_families.py) once, loads it three
times (threads=1, threads=all, threads=idle_cpus()), and times `generate`'s
decode (ms a token, the median over rounds, EOS ignored) with 0, 1, ... busy
processes (pure-Python loops) running beside it. The busy processes start
before the default's count is taken, as a user's other job would.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from report import RESULTS, alternate, build_root, cli_build, publish, table  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.runtime.threads import idle_cpus  # noqa: E402


def busy() -> None:
    while True:
        pass


def ms_per_token(model: flashrt_build.LoadedModule, steps: int) -> float:
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    result = flashrt_build.generate(model, prompt, steps, timed=True)
    return 1e3 * result.decode_s / (result.tokens.shape[1] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", default="0,1,2", help="busy processes beside the package, each count a run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    from llm_families import save_family

    cores = len(os.sched_getaffinity(0))
    rows = []
    with build_root(args.work) as root:
        model_dir = save_family("llama", Path(root) / "llama")
        overrides = ["+module=causal_lm", f"module.pretrained={model_dir}", "module.max_cache_len=128"]
        out, _, _ = cli_build([*overrides, "weights=external"], root)
        for count in [int(n) for n in args.busy.split(",")]:
            others = [multiprocessing.Process(target=busy, daemon=True) for _ in range(count)]
            for process in others:
                process.start()
            try:
                idle = idle_cpus(0.2)
                models = {f"{n} thread(s)": flashrt_build.load(out, threads=n) for n in sorted({1, cores, idle})}
                for model in models.values():
                    ms_per_token(model, 8)  # warm up
                times = alternate({name: lambda m=m: ms_per_token(m, args.steps) for name, m in models.items()},
                                  args.rounds)  # fmt: skip
            finally:
                for process in others:
                    process.terminate()
            for name, values in times.items():
                chosen = "default" if name == f"{idle} thread(s)" else ""
                rows.append([count, name, chosen, f"{statistics.median(values):.3f}", f"{min(values):.3f}"])
    text = table(["busy processes", "threads", "generate's default", "ms/token (median)", "min"], rows, "rr rr")
    text += f"\n{cores} cores; torch {torch.__version__}; a 2-layer, width-64 Llama, {args.steps} decode steps.\n"
    command = "python bench/serve_threads.py " + " ".join(sys.argv[1:])
    publish(RESULTS / "serve_threads_cpu.md", "A CPU package's decode step by thread count", command, text)


if __name__ == "__main__":
    main()
