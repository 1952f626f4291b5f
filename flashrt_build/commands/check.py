"""`python -m flashrt_build.check OUTPUT_DIR CHECKPOINT`: does a checkpoint fit
a built package? Exit 0 fits, 1 does not (every difference listed), 2 it
cannot check (no complete build at OUTPUT_DIR, a checkpoint that is not one)
or the command line is wrong.

Reads the manifest and the checkpoint's names, shapes and dtypes only: no
package is loaded and nothing is compiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import command_verdict


def main(argv: list[str] | None = None) -> int:
    """`python -m flashrt_build.check OUTPUT_DIR CHECKPOINT`: 0 fits, 1 does not, 2 cannot check."""
    parser = argparse.ArgumentParser(
        prog="python -m flashrt_build.check", description="Check that a checkpoint fits a built package."
    )
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("checkpoint", type=Path)
    args = parser.parse_args(argv)
    from ..runtime.checkpoint import check_checkpoint  # torch: not for --help

    return command_verdict(
        lambda: check_checkpoint(args.output_dir, args.checkpoint),
        f"{args.checkpoint} fits {args.output_dir}",
        f"{args.checkpoint} does not fit {args.output_dir}:",
    )


if __name__ == "__main__":
    sys.exit(main())
