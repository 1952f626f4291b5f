"""`python -m flashrt_build.check`: does a checkpoint fit a built package? (flashrt_build/commands/check.py)."""

import sys

from .commands.check import main

if __name__ == "__main__":
    sys.exit(main())
