"""An up-to-date build against a bare Hydra app and against `import torch`.

    .venv/bin/python bench/noop_build.py [--rounds 5] [--before REV]

Builds mlp once, then times, alternating in rounds, three commands in fresh
processes: the same build again (a no-op), a bare Hydra app, and
`python -c "import torch"`. Reports medians and the no-op's ratio to each.
`--before REV`: the no-op of that commit's code too (a git worktree), side by side.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from report import RESULTS, alternate, publish, table

HERE = Path(__file__).resolve().parent


def wall(command: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=cwd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "noop_build.md")
    parser.add_argument("--before", metavar="REV", help="also time the no-op of this commit's code")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        build = [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_root={root}"]
        subprocess.run(build, check=True, capture_output=True)  # the build the no-ops find in place
        commands = {
            "no-op build": (build, None),
            "bare Hydra app": ([sys.executable, str(HERE / "bare_hydra_app.py"), f"hydra.run.dir={root}/bare"], None),
            "import torch": ([sys.executable, "-c", "import torch"], None),
        }
        if args.before:  # its own output root: the tool's source is in the key
            tree = Path(root) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before], check=True, cwd=HERE.parent)
            before = [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_root={root}/before_out"]
            subprocess.run(before, check=True, capture_output=True, cwd=tree)
            commands[f"no-op build at {args.before}"] = (before, tree)
        try:
            times = alternate({name: lambda c=command: wall(*c) for name, command in commands.items()}, args.rounds)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False, cwd=HERE.parent)
    med = {name: statistics.median(t) for name, t in times.items()}
    noop = med["no-op build"]
    rows = [
        [name, f"{med[name]:.2f}", f"{min(t):.2f}", f"{max(t):.2f}", f"{noop / med[name]:.2f}"]
        for name, t in times.items()
    ]
    text = table(["command", "median wall (s)", "min", "max", "no-op / this"], rows)
    publish(
        args.out,
        "No-op build",
        f".venv/bin/python bench/noop_build.py --rounds {args.rounds}"
        + (f" --before {args.before}" if args.before else ""),
        f"2-core CPU, torch {metadata.version('torch')}, {args.rounds} alternating rounds; "
        f"goal: a no-op at most 1.5x the bare Hydra app\n\n{text}",
    )


if __name__ == "__main__":
    main()
