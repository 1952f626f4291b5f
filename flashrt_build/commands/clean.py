"""`python -m flashrt_build.store clean [OUTPUT_ROOT] [--all]`: remove store
entries no output directory links to any more (or all of them). Anything
under the store that is not the store's (a folder without its `sha256`
list, a file, a link, a folder of the user's beside `packages/`, a `.store`
that is itself a link, never walked) is left where it is and named. `--all`
goes before or after the root. Exit 0 cleaned (perhaps nothing), 2 no such
output root or a wrong command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cache.store import STORE_DIR, Store


def main(argv: list[str] | None = None) -> int:
    """`python -m flashrt_build.store clean [OUTPUT_ROOT] [--all]`."""
    parser = argparse.ArgumentParser(prog="python -m flashrt_build.store", description="Manage the build store.")
    parser.add_argument("command", choices=["clean"])
    parser.add_argument("output_root", nargs="?", default="outputs", type=Path)
    parser.add_argument("--all", action="store_true", help="remove every entry, not only unreferenced ones")
    args = parser.parse_intermixed_args(argv)  # `clean --all ROOT` as `clean ROOT --all`
    if not args.output_root.is_dir():
        print(
            f"error: no such output root: {args.output_root} (give the output_root your builds went to)",
            file=sys.stderr,
        )
        return 2
    removed, left = Store(args.output_root).prune(everything=args.all)
    for entry in removed:
        print(f"removed {entry}")
    for entry, why in left:
        print(f"left {entry}: {why}")
    print(f"{len(removed)} store entries removed from {args.output_root / STORE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
