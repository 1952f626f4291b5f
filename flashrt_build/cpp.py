"""`python -m flashrt_build.cpp --cmake-dir`: where the C++ library's CMake project is (flashrt_build/commands/cpp.py)."""

import sys

from .commands.cpp import main

if __name__ == "__main__":
    sys.exit(main())
