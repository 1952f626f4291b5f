"""A sweep of CUDA builds over every GPU of the host against the same sweep on
one GPU: wall time, and which GPU built each package when.

    CXX=g++-12 python bench/multi_gpu_sweep.py [--modules mlp,bert_tiny,gpt2_tiny] [--weights baked,external]

Both runs are cold (fresh output root and Inductor cache). The multi-GPU run
uses the parallel launcher with one job per GPU; the one-GPU run the same
launcher with CUDA_VISIBLE_DEVICES set to the first GPU, so its jobs take turns
on it. Then every package of the multi-GPU run is loaded on a GPU other than
the one that built it and run, to show a package moves between indices.
Prints the per-GPU timeline and writes bench/results/multi_gpu_sweep.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from report import RESULTS, publish, table  # noqa: E402

from flashrt_build.sweep.gpus import visible_gpus  # noqa: E402


def run_sweep(args: argparse.Namespace, root: Path, gpus: list[str]) -> tuple[float, dict[str, Any]]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    command = [sys.executable, "-m", "flashrt_build", "-m", "hydra/launcher=parallel"]
    command += [f"hydra.launcher.n_jobs={len(gpus)}", f"+module={args.modules}", "target=cuda"]
    command += [f"weights={args.weights}", f"output_root={root / 'out'}", f"hydra.sweep.dir={root / 'sweep'}"]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=False, capture_output=True)
    wall = time.perf_counter() - start
    return wall, json.loads((root / "sweep" / "sweep_summary.json").read_text())


def timeline(summary: dict[str, Any]) -> list[str]:
    rows = [r for r in summary["rows"] if r.get("build_started_at")]
    origin = min((r["started_at"] for r in summary["rows"]), default=0.0)
    lines = []
    for gpu in sorted({r["gpu"] for r in rows}, key=str):
        held = [r for r in rows if r["gpu"] == gpu]
        spans = sorted((r["build_started_at"] - origin, r["build_finished_at"] - origin, r["job"], r) for r in held)
        text = ", ".join(f"job {r['job']} {r.get('name')} {' '.join(r['overrides'][2:])} {a:.0f}-{b:.0f}s"
                         for a, b, _, r in spans)  # fmt: skip
        lines.append(f"GPU {gpu}: {text}")
    return lines


def load_elsewhere(summary: dict[str, Any], gpus: list[str]) -> list[str]:
    """Load each package on another visible index than the one that built it, and run it."""
    import torch

    import flashrt_build
    from flashrt_build.config.compose import compose
    from flashrt_build.config.spec import resolve_spec
    from flashrt_build.stages.inputs import make_inputs

    lines = []
    for row in summary["rows"]:
        if row["status"] == "failed":
            continue
        built_on = gpus.index(row["gpu"]) if row.get("gpu") in gpus else 0
        other = (built_on + 1) % len(gpus)
        device = f"cuda:{other}"
        model = flashrt_build.load(Path(row["output_dir"]), device=device)
        spec = resolve_spec(compose([f"+module={row['name']}", "target=cuda", f"target.device={device}"]))
        example = make_inputs(spec)
        with torch.no_grad():
            model(*example.args, **example.kwargs)
        lines.append(f"job {row['job']}: built on GPU {row.get('gpu')}, loaded and run on {device}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modules", default="mlp,bert_tiny,gpt2_tiny")
    parser.add_argument("--weights", default="baked,external")
    parser.add_argument("--out", type=Path, default=RESULTS / "multi_gpu_sweep.md")
    args = parser.parse_args()
    gpus = visible_gpus()
    if len(gpus) < 2:
        raise SystemExit(f"needs two or more GPUs; this machine shows {len(gpus)}")
    with tempfile.TemporaryDirectory() as many, tempfile.TemporaryDirectory() as one:
        wall_many, summary_many = run_sweep(args, Path(many), gpus)
        wall_one, summary_one = run_sweep(args, Path(one), gpus[:1])
        moved = load_elsewhere(summary_many, gpus)
    used = sorted({r.get("gpu") for r in summary_many["rows"] if r.get("gpu") is not None}, key=str)
    runs = [
        [f"{len(gpus)} GPUs", summary_many, ", ".join(used), wall_many],
        ["1 GPU", summary_one, gpus[0], wall_one],
    ]
    rows = [[n, s["jobs"], s["counts"]["built"], s["counts"]["failed"], g, f"{w:.1f}"] for n, s, g, w in runs]
    text = "\n".join(
        [
            table(["run", "jobs", "built", "failed", "GPUs used", "wall (s)"], rows, align="lrrrlr"),
            f"Speed-up: **{wall_one / wall_many:.2f}x**; every GPU used: {'yes' if len(used) == len(gpus) else 'no'}",
            "",
            "Timeline of the multi-GPU run (seconds from the sweep's start):",
            "",
            *[f"- {line}" for line in timeline(summary_many)],
            "",
            "Packages on another index:",
            "",
            *[f"- {line}" for line in moved],
        ]
    )
    command = f"CXX=g++-12 python bench/multi_gpu_sweep.py --modules {args.modules} --weights {args.weights}"
    publish(args.out, f"Multi-GPU sweep: {len(gpus)} GPUs vs 1", command, text + "\n")


if __name__ == "__main__":
    main()
