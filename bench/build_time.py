"""A causal LM's whole build, stage by stage, against an earlier commit's code.

    .venv/bin/python bench/build_time.py [--before REV] [--rounds 1]

Writes a random Llama of SmolLM2-135M's shape (30 layers, 576 wide, 9 heads,
3 KV heads, an MLP of 1536, 49152 tokens, tied embeddings) with
save_pretrained, then builds it as a user would (`+module=causal_lm
module.pretrained=DIR`, the defaults: a cache of 4096), `force=true`, in a
fresh process: wall time and the manifest's stage timings. `--before REV`
builds the same model with that commit's code (a git worktree) too,
alternating. Figures: bench/results/build_time.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import RESULTS, alternate, publish, table

HERE = Path(__file__).resolve().parent
SMOLLM2_135M = "layers=30,hidden=576,heads=9,kv_heads=3,mlp=1536,vocab=49152"


def build(directory: Path, root: Path, cwd: Path, extra: list[str]) -> tuple[float, dict[str, float]]:
    """One forced build in a fresh process: (wall seconds, the manifest's stage timings)."""
    command = [sys.executable, "-m", "flashrt_build", "+module=causal_lm", f"module.pretrained={directory}",
               f"output_root={root}", "force=true", *extra]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the build at {cwd} failed:\n{done.stderr[-3000:]}")
    manifest = next(p for p in root.rglob("manifest.json") if ".store" not in p.parts)
    return wall, json.loads(manifest.read_text())["timings"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default=SMOLLM2_135M)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", metavar="REV", help="also build with this commit's code, alternating")
    parser.add_argument("--extra", action="append", default=[], metavar="OVERRIDE", help="more build overrides")
    parser.add_argument("--out", type=Path, default=RESULTS / "build_time.md")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from causal_lm import save_model

    with tempfile.TemporaryDirectory() as work:
        directory = save_model(Path(work) / "model", args.size, torch.float32)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE.parent, check=False).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "diff", "--quiet"], cwd=HERE.parent, check=False).returncode != 0
        trees = {f"this code ({head}{', changed' if dirty else ''})": HERE.parent}
        if args.before:
            trees[f"at {args.before}"] = Path(work) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[f"at {args.before}"]), args.before],
                           check=True, cwd=HERE.parent, capture_output=True)  # fmt: skip
        timings: dict[str, list[dict[str, float]]] = {name: [] for name in trees}

        def timed(name: str) -> float:
            wall, stages = build(directory, Path(work) / name.replace(" ", "_"), trees[name], args.extra)
            timings[name].append(stages)
            print(f"{name}: {wall:.1f} s {stages}", file=sys.stderr, flush=True)
            return wall

        try:
            walls = alternate({name: lambda n=name: timed(n) for name in trees}, args.rounds)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[f"at {args.before}"])],
                               check=False, cwd=HERE.parent)  # fmt: skip
    first = next(iter(trees))
    stages = sorted({stage for runs in timings.values() for run in runs for stage in run})
    rows = [["wall (median)", *(f"{statistics.median(walls[name]):.1f}" for name in trees)]]
    rows += [[stage, *(f"{statistics.median(run.get(stage, 0) for run in timings[name]):.1f}" for name in trees)]
             for stage in stages]  # fmt: skip
    ours = statistics.median(walls[first])
    ratios = [f"{ours / statistics.median(walls[n]):.2f}x ({n})" for n in list(trees)[1:]]
    ratio = f"\n\n{first}'s wall / the other's: {', '.join(ratios)}" if ratios else ""
    command = "python bench/build_time.py" + "".join(f" {a}" for a in sys.argv[1:])
    text = (f"A random Llama of shape {args.size}, float32 on the CPU (2 cores), `+module=causal_lm "
            f"module.pretrained=DIR force=true`, a fresh process each, {args.rounds} alternating round(s); "
            f"seconds\n\n{table(['stage', *trees], rows)}{ratio}")  # fmt: skip
    publish(args.out, "A causal LM's build, stage by stage", command, text)
    print(text)


if __name__ == "__main__":
    main()
