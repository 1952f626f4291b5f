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
from importlib import metadata
from pathlib import Path

from report import RESULTS, alternate, publish, table


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
    parser.add_argument("--out", type=Path, default=RESULTS / "verify_overhead.md")
    args = parser.parse_args()
    walls = alternate(
        {
            "off": lambda: wall(f"+module={args.module}", "verify.enabled=false"),
            "on": lambda: wall(f"+module={args.module}"),
        },
        args.rounds,
        rotate=False,
    )
    off_s, on_s = statistics.median(walls["off"]), statistics.median(walls["on"])
    header = ["module", "build, verify off (s)", "build, verify on (s)", "verification adds (s)", "on/off"]
    row = [args.module, f"{off_s:.1f}", f"{on_s:.1f}", f"{on_s - off_s:.1f}", f"{on_s / off_s:.2f}"]
    publish(
        args.out,
        "Verification overhead",
        f".venv/bin/python bench/verify_overhead.py --module {args.module} --rounds {args.rounds}",
        f"median of {args.rounds} alternating CLI builds each, 2-core CPU, torch {metadata.version('torch')}"
        f"\n\n{table(header, [row])}",
    )


if __name__ == "__main__":
    main()
