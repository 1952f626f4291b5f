"""What verification adds to the wall time of a build.

    .venv/bin/python bench/verify_overhead.py [--module mlp] [--rounds 3]

Builds the same config through the CLI with verify.enabled=false and true,
alternating, each into a fresh output root, and reports the median wall times
and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def wall(*overrides: str) -> float:
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "flashrt_build", *overrides, f"output_root={root}"], check=True, capture_output=True
        )
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", default="mlp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/verify_overhead.md"))
    args = parser.parse_args()
    off, on = [], []
    for _ in range(args.rounds):
        off.append(wall(f"+module={args.module}", "verify.enabled=false"))
        on.append(wall(f"+module={args.module}"))
    off_s, on_s = statistics.median(off), statistics.median(on)
    text = (
        f"| module | build, verify off (s) | build, verify on (s) | verification adds (s) | on/off |\n"
        f"|---|---|---|---|---|\n"
        f"| {args.module} | {off_s:.1f} | {on_s:.1f} | {on_s - off_s:.1f} | {on_s / off_s:.2f} |\n"
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Verification overhead\n\n"
        f"Command: `.venv/bin/python bench/verify_overhead.py --module {args.module} --rounds {args.rounds}` "
        f"(median of {args.rounds} alternating CLI builds each, 2-core CPU, torch 2.13)\n\n{text}"
    )


if __name__ == "__main__":
    main()
