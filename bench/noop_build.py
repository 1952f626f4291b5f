"""An up-to-date build against a bare Hydra app and against `import torch`.

    .venv/bin/python bench/noop_build.py [--rounds 5]

Builds mlp once, then times, alternating in rounds, three commands in fresh
processes: the same build again (a no-op), a bare Hydra app, and
`python -c "import torch"`. Reports medians and the no-op's ratio to each.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "noop_build.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        build = [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_root={root}"]
        subprocess.run(build, check=True, capture_output=True)  # the build the no-ops find in place
        commands = {
            "no-op build": build,
            "bare Hydra app": [sys.executable, str(HERE / "bare_hydra_app.py"), f"hydra.run.dir={root}/bare"],
            "import torch": [sys.executable, "-c", "import torch"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, command in commands.items():
                times[name].append(wall(command))
    med = {name: statistics.median(t) for name, t in times.items()}
    noop = med["no-op build"]
    lines = ["| command | median wall (s) | min | max | no-op / this |", "|---|---|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {med[name]:.2f} | {min(t):.2f} | {max(t):.2f} | {noop / med[name]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# No-op build\n\n"
        f"Command: `.venv/bin/python bench/noop_build.py --rounds {args.rounds}` (2-core CPU, torch 2.13, "
        f"{args.rounds} alternating rounds; goal: no-op at most 1.5 s)\n\n{text}"
    )


if __name__ == "__main__":
    main()
