"""CUDA specifics: the TF32 policy a package is built and run with, and the
GPU architecture a package was compiled for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .errors import ArtifactError, ConfigError


def check_device(device: str) -> None:
    """A CUDA target needs that GPU here: a ConfigError naming what is missing."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else "none is visible"
        raise ConfigError("target.device", device, f"no CUDA device is available here: {why} (use target=cpu)")
    index, count = torch.device(device).index or 0, torch.cuda.device_count()
    if index >= count:
        raise ConfigError("target.device", device, f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")


@contextlib.contextmanager
def fp32_precision(tf32: bool | None) -> Iterator[None]:
    """Float32 matmuls and convolutions in TF32 (`True`) or full precision
    (`False`) inside the block; `None` leaves torch's settings alone. Inductor
    reads the setting while compiling (its Triton kernels) and extern kernels
    (cuBLAS, cuDNN) read it on every call, so builds and loaded packages both
    run under it."""
    if tf32 is None:
        yield
        return
    value = "tf32" if tf32 else "ieee"
    backends = [b for b in (torch.backends.cuda.matmul, torch.backends.cudnn) if hasattr(b, "fp32_precision")]
    before = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = value
    try:
        yield
    finally:
        for backend, old in zip(backends, before, strict=True):
            backend.fp32_precision = old


def check_gpu_arch(built_on: dict[str, Any] | None, device: torch.device, running: dict[str, Any] | None) -> None:
    """Refuse a CUDA package on a GPU of another compute capability: its
    kernels are compiled for the build's architecture, and on another one they
    fail obscurely (or, worse, on the first call)."""
    if device.type != "cuda" or built_on is None:
        return
    if running is None:
        raise ArtifactError(f"the package was built for CUDA ({built_on['name']}) but {device} is not available")
    if running["capability"] != built_on["capability"]:
        raise ArtifactError(
            f"the package was compiled for compute capability {built_on['capability']} ({built_on['name']}), "
            f"but {device} is {running['name']} (compute capability {running['capability']}): "
            "rebuild it with target=cuda on this kind of GPU"
        )
