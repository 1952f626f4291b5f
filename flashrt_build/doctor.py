"""`python -m flashrt_build.doctor`: the toolchain check and canary build (flashrt_build/commands/doctor.py)."""

import sys

from .commands.doctor import main

if __name__ == "__main__":
    sys.exit(main())
