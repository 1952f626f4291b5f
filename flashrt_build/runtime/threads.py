"""The CPU threads a loaded package's calls run on: torch's count, which a
CPU package's OpenMP regions and its extern kernels read, set around each
call and put back after."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch


def check_threads(threads: int | None) -> int | None:
    """A thread count a call may run on: an integer >= 1, or None."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r}: expected a thread count >= 1, or None for this process's setting")
    return threads


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's (and OpenMP's, which a CPU package's kernels use) thread count
    for the calls inside, as it was after."""
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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
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
