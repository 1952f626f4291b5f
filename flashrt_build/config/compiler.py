"""Which C++ compiler a build uses and what it is, without importing torch:
the build key (computed torch-free) and the manifest both name it."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.splitlines()[0].strip() if out.stdout else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def compiler_path(cxx: str | None) -> str:
    """The compiler Inductor will call: toolchain.cxx, else $CXX, else g++."""
    name = cxx or os.environ.get("CXX") or "g++"
    return shutil.which(name) or name


def cpu_isa() -> str:
    """The vector ISA a CPU package is compiled for by default (-march=native)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return platform.machine()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    return "AVX2" if "avx2" in flags else platform.machine()
