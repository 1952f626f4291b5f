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

from ..errors import ConfigError


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


def check_compiler(cxx: str | None) -> None:
    """The compiler a build would call must exist: `toolchain.cxx`, else the
    CXX environment variable, else g++. A ConfigError names whichever chose it."""
    if cxx is not None:
        if shutil.which(cxx) is None:
            raise ConfigError("toolchain.cxx", cxx, "no such compiler on PATH")
    elif os.environ.get("CXX"):
        if shutil.which(os.environ["CXX"]) is None:
            raise ConfigError(
                "CXX",
                os.environ["CXX"],
                "no such compiler on PATH; with toolchain.cxx null the build uses $CXX: fix it or set toolchain.cxx",
                "environment variable",
            )
    elif shutil.which("g++") is None:
        raise ConfigError("toolchain.cxx", None, "no C++ compiler: g++ is not on PATH; set toolchain.cxx or CXX")


@functools.cache
def march_rejected(cxx: str, march: str) -> str | None:
    """None when the compiler accepts `-march=<march>`, else its complaint."""
    try:
        out = subprocess.run(
            [cxx, f"-march={march}", "-x", "c++", "-fsyntax-only", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if out.returncode == 0:
        return None
    lines = [line.strip() for line in out.stderr.splitlines() if "error" in line.lower()]
    return (lines or out.stderr.strip().splitlines() or ["failed"])[0]
