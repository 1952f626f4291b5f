"""`python -m flashrt_build.repro`: rebuild a release artifact and compare it (flashrt_build/commands/repro.py)."""

import sys

from .commands.repro import main

if __name__ == "__main__":
    sys.exit(main())
