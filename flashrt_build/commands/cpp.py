"""`python -m flashrt_build.cpp --cmake-dir`: the directory holding the C++
library's `CMakeLists.txt` (its sources ship in the wheel), for a CMake
project's `add_subdirectory`, the way `torch.utils.cmake_prefix_path` serves
libtorch:

    add_subdirectory(${FLASHRT_DIR} flashrt)   # FLASHRT_DIR: what --cmake-dir prints
    target_link_libraries(my_server PRIVATE flashrt::flashrt)

Exit 0 with the path on stdout; 2 for a wrong command line."""

from __future__ import annotations

import argparse

from ..config.shipped import CPP_DIR


def main(argv: list[str] | None = None) -> int:
    """`python -m flashrt_build.cpp --cmake-dir`."""
    parser = argparse.ArgumentParser(
        prog="python -m flashrt_build.cpp", description="Where the flashrt C++ library's sources are."
    )
    parser.add_argument(
        "--cmake-dir",
        action="store_true",
        required=True,
        help="print the directory holding its CMakeLists.txt (for add_subdirectory)",
    )
    parser.parse_args(argv)
    print(CPP_DIR)
    return 0
