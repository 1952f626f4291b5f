"""Dual-baseline timing: the package against eager and torch.compile of the
same module, side by side in one process, alternating, on the target device.

Absolute times move between runs and machines; variants timed alternately in
one process are comparable, so the ratios are what to read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_side_by_side(
    variants: Mapping[str, Callable[[], Any]],
    device: torch.device,
    warmup: int = 3,
    rounds: int = 5,
    iterations: int = 10,
) -> dict[str, Any]:
    """Median, min and max milliseconds per call of each variant over `rounds`
    alternating rounds of `iterations` calls, after `warmup` calls each."""
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        _sync(device)
        per_round: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                _sync(device)
                start = time.perf_counter()
                for _ in range(iterations):
                    fn()
                _sync(device)
                per_round[name].append((time.perf_counter() - start) * 1000 / iterations)
    result: dict[str, Any] = {
        "device": str(device),
        "warmup": warmup,
        "rounds": rounds,
        "iterations": iterations,
        "ms": {name: {"median": statistics.median(t), "min": min(t), "max": max(t)} for name, t in per_round.items()},
    }
    if "package" in per_round:
        package = statistics.median(per_round["package"])
        result["speedup"] = {
            f"package_vs_{name}": statistics.median(t) / package for name, t in per_round.items() if name != "package"
        }
    return result
