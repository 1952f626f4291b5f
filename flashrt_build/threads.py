"""How many CPU threads one build may use, so parallel builds share the cores
instead of each assuming it has all of them."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

# Read by torch's thread pools and by Inductor's compile workers at start-up;
# inherited by the verification process.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")

# A parallel sweep runs at most this many builds at once by default: each holds
# its model, the exported graph and a compiler in memory.
MAX_DEFAULT_JOBS = 8


def available_cpus() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def default_parallel_jobs() -> int:
    """Concurrent builds of a parallel sweep unless told: one per core, at most 8."""
    return max(1, min(available_cpus(), MAX_DEFAULT_JOBS))


def threads_env(threads: int) -> dict[str, str]:
    """Environment limiting a process that has not imported torch yet."""
    return {name: str(threads) for name in THREAD_ENV_VARS}


def apply_threads(threads: int | None) -> None:
    """Limit this process, and the processes it starts, to `threads` CPU threads."""
    if not threads:
        return
    os.environ.update(threads_env(threads))
    torch = sys.modules.get("torch")
    if torch is not None:  # already started: tell its pools directly
        import torch._inductor.config as inductor_config

        torch.set_num_threads(threads)
        inductor_config.compile_threads = threads


def job_threads(launcher: Mapping[str, Any], cpus: int) -> int | None:
    """Threads for one job of a sweep, from its launcher's config: the cores
    divided among joblib's concurrent jobs; a submitit job's `cpus_per_task`;
    None (all cores) for launchers that run one job at a time."""
    target = str(launcher.get("_target_", "")).lower()
    if "joblib" in target:
        n_jobs = int(launcher.get("n_jobs") or -1)
        concurrent = n_jobs if n_jobs > 0 else max(1, cpus + 1 + n_jobs)  # joblib: -1 all cores, -2 all but one
        return max(1, cpus // min(concurrent, cpus))
    if "submitit" in target:
        return launcher.get("cpus_per_task")
    return None
