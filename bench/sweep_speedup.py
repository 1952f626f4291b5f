"""A sweep of four cold builds through the basic launcher (one job at a time)
against the parallel (joblib) launcher, side by side.

    .venv/bin/python bench/sweep_speedup.py [--rounds 2] [--jobs N]

Each run starts cold: a fresh output root (so no store, nothing up to date)
and a fresh Inductor cache. Runs alternate ABBA so drift hits both launchers.
Reports each run's wall time, the per-job build times from the sweep summary,
and the speed-up (basic / parallel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from report import RESULTS, publish, table

HERE = Path(__file__).resolve().parent
SWEEP = ["+module=mlp,gpt2_tiny", "weights=baked,external"]


def run_sweep(launcher: list[str], root: Path) -> tuple[float, dict]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
    command = [sys.executable, "-m", "flashrt_build", "-m", *SWEEP, *launcher]
    command += [f"output_root={root / 'out'}", f"hydra.sweep.dir={root / 'sweep'}"]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - start
    return wall, json.loads((root / "sweep" / "sweep_summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=None, help="parallel jobs (default: the shipped config's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sweep_speedup.md")
    args = parser.parse_args()
    launchers = {
        "basic": [],
        "parallel": ["hydra/launcher=parallel", *([f"hydra.launcher.n_jobs={args.jobs}"] if args.jobs else [])],
    }
    order = [
        name for r in range(args.rounds) for name in (["basic", "parallel"] if r % 2 == 0 else ["parallel", "basic"])
    ]
    walls: dict[str, list[float]] = {name: [] for name in launchers}
    job_walls: dict[str, list[float]] = {name: [] for name in launchers}
    threads: dict[str, set] = {name: set() for name in launchers}
    for name in order:
        with tempfile.TemporaryDirectory() as root:
            wall, summary = run_sweep(launchers[name], Path(root))
        assert summary["counts"]["built"] == 4, summary["counts"]
        walls[name].append(wall)
        job_walls[name] += [row["wall_s"] for row in summary["rows"]]
        threads[name] |= {row["threads"] for row in summary["rows"]}
        print(f"{name}: {wall:.1f} s", flush=True)
    med = {name: statistics.median(w) for name, w in walls.items()}
    rows = [
        [
            name,
            f"{med[name]:.1f}",
            ", ".join(f"{w:.1f}" for w in walls[name]),
            f"{statistics.median(job_walls[name]):.1f}",
            ", ".join(str(t) for t in sorted(threads[name], key=str)),
        ]
        for name in launchers
    ]
    text = table(["launcher", "sweep wall (s), median", "runs", "job wall (s), median", "threads per job"], rows)
    text += f"\nSpeed-up (basic / parallel): **{med['basic'] / med['parallel']:.2f}x**\n"
    cpus = len(os.sched_getaffinity(0))
    publish(
        args.out,
        "Sweep: basic launcher vs parallel (joblib)",
        f".venv/bin/python bench/sweep_speedup.py --rounds {args.rounds}",
        f"{cpus}-core CPU, torch {metadata.version('torch')}; sweep `{' '.join(SWEEP)}`: 4 cold builds, "
        "verification included; "
        f"runs alternate ABBA\n\n{text}",
    )


if __name__ == "__main__":
    main()
