"""`python -m flashrt_build.store`: store clean: prune the build store (flashrt_build/commands/clean.py)."""

import sys

from .commands.clean import main

if __name__ == "__main__":
    sys.exit(main())
