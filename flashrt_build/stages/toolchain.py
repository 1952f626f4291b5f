"""What produced a package: torch, Python, the C++ compiler, CUDA and the CPU."""

from __future__ import annotations

import hashlib
import platform
import shutil
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..config.compiler import compiler_version
from ..runtime.gpu import gpu_of


def cpp_compiler(options: Mapping[str, Any]) -> str:
    """The compiler Inductor will call, honouring a `cpp.cxx` option."""
    from torch._inductor import cpp_builder

    with torch._inductor.config.patch({k: v for k, v in options.items() if k == "cpp.cxx"}):
        cxx = cpp_builder.get_cpp_compiler()
    return shutil.which(cxx) or cxx


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe_toolchain(device: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The toolchain section of the manifest."""
    cxx = cpp_compiler(options)
    gpu = gpu_of(device)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hydra_core": _version("hydra-core"),
        "omegaconf": _version("omegaconf"),
        "safetensors": _version("safetensors"),
        "cxx": {"path": cxx, "version": compiler_version(cxx)},
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "lock": _lock_file(),
    }


def _lock_file() -> dict[str, str] | None:
    """The pinned lock this checkout installs from (requirements.lock), if any."""
    path = Path(__file__).resolve().parents[2] / "requirements.lock"
    if not path.is_file():
        return None
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
