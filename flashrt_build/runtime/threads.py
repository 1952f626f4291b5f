"""The CPU threads a loaded package's calls run on: torch's count, which a
CPU package's OpenMP regions and its extern kernels read, set around each
call and put back after; at most `THREADS_PER_CORE` times the cores this
process may run on (`max_threads`). Torch-free until a call sets the count:
`python -m flashrt_build.generate` checks --threads before importing torch."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

# A CPU package's OpenMP threads spin while they wait for each other: past the
# cores, every thread only waits (5,000 on 2 cores: 0.6 s a token; 100,000
# crashed the process). A few times the cores leaves room to measure that.
THREADS_PER_CORE = 4


def usable_cpus() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def max_threads() -> int:
    """The most CPU threads a call may run on: `THREADS_PER_CORE` times the usable cores."""
    return THREADS_PER_CORE * usable_cpus()


def threads_expected() -> str:
    """What a thread count is expected to be, for a refusal naming `threads` or `--threads`."""
    cores = usable_cpus()
    return (
        f"expected a thread count >= 1 and at most {max_threads()} ({THREADS_PER_CORE} times the {cores} "
        f"core{'s' if cores > 1 else ''} this process may run on; past them every thread waits on a busy core)"
    )


def check_threads(threads: int | None) -> int | None:
    """A thread count a call may run on: an integer from 1 to `max_threads()`, or None."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= max_threads():
        raise ValueError(f"threads={threads!r}: {threads_expected()}, or None for this process's setting")
    return threads


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's (and OpenMP's, which a CPU package's kernels use) thread count
    for the calls inside, as it was after."""
    import torch

    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def idle_cpus(sample_s: float = 0.05) -> int:
    """The cores this process may run on that other work leaves idle, from
    the system's CPU time over a short sample (Linux's /proc/stat); at least
    one. A CPU package's OpenMP threads spin while they wait for each other:
    more threads than idle cores make every call wait on the busy ones."""
    cores = usable_cpus()
    try:
        first = _cpu_times()
        time.sleep(sample_s)
        second = _cpu_times()
    except (OSError, ValueError, IndexError):
        return cores
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle and iowait
    if total <= 0:
        return cores
    machine = os.cpu_count() or cores
    busy = round(machine * (1 - idle / total))  # cores the whole machine keeps busy
    return max(1, min(cores, machine - busy))


def _cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1:]]
