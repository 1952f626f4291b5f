"""One build per GPU at a time: the jobs of a sweep on a multi-GPU host share
the GPUs through a lock file per GPU, and each build process sees only the
GPU it holds (CUDA_VISIBLE_DEVICES, set before CUDA starts).

The locks are host-wide and released by the kernel when their process ends,
so concurrent sweeps share the GPUs too and a killed job frees its GPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("flashrt_build")

LOCK_DIR = Path(tempfile.gettempdir()) / "flashrt_build-gpus"
# A GPU count to assume instead of asking the driver: dry runs and tests.
FAKE_GPUS_ENV = "FLASHRT_GPUS"
# Builds that may share one GPU (default 1). Compiling is mostly CPU work, so
# a machine with many cores and one GPU builds faster with 2-4; autotuning
# (max_autotune) then times kernels on a shared GPU.
BUILDS_PER_GPU_ENV = "FLASHRT_BUILDS_PER_GPU"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries, without
    starting CUDA: the fake count if set, the visible list if set, else nvidia-smi."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        return [str(i) for i in range(int(fake))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def _device_index(device: str) -> int | None:
    _, _, index = device.partition(":")
    return int(index) if index else None


@contextlib.contextmanager
def gpu_slot(
    device: str, gpus: list[str] | None = None, sleep: Callable[[float], None] = time.sleep
) -> Iterator[dict[str, str] | None]:
    """Hold a GPU for one build of a CUDA target; yields the environment the
    build process needs ({} for an explicit index, which names its GPU
    itself) or None for CPU targets and machines without GPUs."""
    if not device.startswith("cuda"):
        yield None
        return
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        yield None  # the build itself reports that there is no GPU
        return
    index = _device_index(device)
    candidates = [gpus[index]] if index is not None and index < len(gpus) else gpus
    per_gpu = int(os.environ.get(BUILDS_PER_GPU_ENV) or 1)
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        for slot, gpu in ((slot, gpu) for slot in range(per_gpu) for gpu in candidates):  # spread over GPUs first
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", gpu) + (f"-{slot}" if slot else "")
            handle = open(LOCK_DIR / f"gpu-{name}.lock", "w")  # noqa: SIM115
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                env = {} if index is not None else {"CUDA_VISIBLE_DEVICES": gpu}
                yield {**env, "FLASHRT_GPU": gpu}
            finally:
                handle.close()  # releases the lock
            return
        if not waited:
            log.info("waiting for a free GPU (%d in use by other builds)", len(candidates))
            waited = True
        sleep(0.5)
