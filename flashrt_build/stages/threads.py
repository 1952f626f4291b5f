"""How many CPU threads one build may use, so parallel builds share the cores
instead of each assuming it has all of them."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

# Inductor's compile workers, read at start-up. Not OMP_NUM_THREADS: Inductor
# generates CPU kernels for the build process's thread count, so limiting it
# would change the package (and make a parallel sweep's packages serial).
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
# Threads the verification process runs the package and eager with.
RUN_THREADS_ENV = "FLASHRT_THREADS"

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
    """Environment limiting a build process that has not imported torch yet."""
    return {COMPILE_THREADS_ENV: str(threads), RUN_THREADS_ENV: str(threads)}


def apply_threads(threads: int | None) -> None:
    """Limit this build's compile workers and the processes it starts to
    `threads` CPU threads; the code Inductor generates stays the same."""
    if not threads:
        return
    os.environ.update(threads_env(threads))
    if "torch._inductor.config" in sys.modules:  # already read the variable: tell it directly
        from torch._inductor import config

        config.compile_threads = threads


def limit_run_threads() -> None:
    """In a verification process: run with the build's share of the cores."""
    threads = os.environ.get(RUN_THREADS_ENV)
    if threads:
        import torch

        torch.set_num_threads(int(threads))


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
