"""CUDA specifics: the TF32 policy a package is built and run with, and the
GPU architecture a package was compiled for."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ArtifactError, ConfigError


@dataclass
class _Policy:
    """One policy in force: the flags it replaced and the threads inside it."""

    value: str
    saved: list[str]
    holders: Counter[int] = field(default_factory=Counter)


# torch's float32 precision flags are process-wide. Threads under the same
# policy share it; a thread wanting another waits until the others leave, so
# no call runs under a policy it did not ask for. A thread that is the only
# one inside may nest another policy (restored when it leaves).
_policies: list[_Policy] = []
_policies_changed = threading.Condition()


def _precision_backends() -> list[Any]:
    return [b for b in (torch.backends.cuda.matmul, torch.backends.cudnn) if hasattr(b, "fp32_precision")]


@contextlib.contextmanager
def fp32_precision(tf32: bool | None) -> Iterator[None]:
    """Float32 matmuls and convolutions in TF32 (`True`) or full precision
    (`False`) inside the block; `None` leaves torch's settings alone. Inductor
    reads the setting while compiling (its Triton kernels) and extern kernels
    (cuBLAS, cuDNN) read it on every call, so builds and loaded float32 CUDA
    packages both run under it. Safe when several threads call at once."""
    if tf32 is None:
        yield
        return
    value, me = ("tf32" if tf32 else "ieee"), threading.get_ident()
    backends = _precision_backends()
    with _policies_changed:
        while True:
            holders = {t for p in _policies for t in p.holders}
            top = _policies[-1] if _policies else None
            if top is not None and top.value == value and (len(_policies) == 1 or holders == {me}):
                break  # join the policy in force
            if top is None or holders == {me}:
                top = _Policy(value, [b.fp32_precision for b in backends])
                for backend in backends:
                    backend.fp32_precision = value
                _policies.append(top)
                break
            _policies_changed.wait()
        top.holders[me] += 1
    try:
        yield
    finally:
        with _policies_changed:
            top.holders[me] -= 1
            if not top.holders[me]:
                del top.holders[me]
            if not top.holders:  # the last thread out restores what the policy replaced
                for backend, old in zip(backends, top.saved, strict=True):
                    backend.fp32_precision = old
                _policies.remove(top)
                _policies_changed.notify_all()


def gpu_of(device: str) -> dict[str, Any] | None:
    """Name and compute capability of a CUDA target's GPU; None for the CPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "index": index,
        "uuid": str(getattr(props, "uuid", "")) or None,  # which GPU of a multi-GPU host
        "memory_gb": round(props.total_memory / 2**30, 1),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # index is within these
    }


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


def check_device(given: str | torch.device | None, target: str, name: str = "device") -> torch.device:
    """The device a package runs on: `given`, else the build's `target`
    (target.device). Refused, as a ConfigError naming the argument `name`
    (`device` for `load`, `--device` for generate), where the package cannot
    run: a name torch does not know, no usable CUDA device, an index past
    this machine's devices, a CPU index other than 0 (`cpu:1`), a device type
    other than the build's target."""
    value = given if given is not None else target
    shown = str(value) if isinstance(value, torch.device) else value
    origin = "" if given is not None else f" (the build's target; {name} was not given)"
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(name, shown, "expected cpu, cuda or cuda:N", kind="argument") from None
    if device.type == "cpu" and device.index:  # torch takes `cpu:1`; nothing that reads weights does
        raise ConfigError(name, shown, f"the CPU has no devices by index: expected cpu{origin}", kind="argument")
    if device.type == "cpu":
        device = torch.device("cpu")  # `cpu:0` is the CPU, which safetensors knows only as `cpu`
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(name, shown, f"no CUDA device is usable on this machine{origin}", kind="argument")
        if (device.index or 0) >= count:
            raise ConfigError(name, shown, f"this machine has {count} CUDA device(s){origin}", kind="argument")
    if device.type != torch.device(target).type:
        raise ConfigError(
            name, shown, f"the package was built for {target} (target.device): its code runs there", kind="argument"
        )
    return device
