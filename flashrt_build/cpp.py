"""`python -m flashrt_build.cpp --cmake-dir`: the C++ library's CMake project (flashrt_build/commands/cpp.py)."""

import sys

from .commands.cpp import main

if __name__ == "__main__":
    sys.exit(main())
