"""Stage 6: the package must agree with the eager module before it is published."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .errors import VerifyError
from .inputs import ExampleInputs

# (atol, rtol) per output dtype. A leaf passes when its max absolute error is
# within atol or its relative error ||out - ref|| / ||ref|| is within rtol.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-8, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 2e-2),
}


@dataclass
class LeafResult:
    path: str
    shape: list[int]
    dtype: str
    max_abs_err: float
    rel_err: float
    atol: float
    rtol: float
    passed: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tolerances(dtype: torch.dtype, atol: float | None, rtol: float | None) -> tuple[float, float]:
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)


def compare_outputs(out: Any, ref: Any, atol: float | None, rtol: float | None) -> list[LeafResult]:
    """Compare every leaf of two output trees (tuples, dicts, model outputs)."""
    out_leaves, out_spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    if out_spec != ref_spec:
        raise VerifyError(f"the package returns a different output structure: {out_spec} instead of {ref_spec}")
    paths = [pytree.keystr(p) or "output" for p, _ in pytree.tree_flatten_with_path(ref)[0]]
    return [_compare_leaf(path, o, r, atol, rtol) for path, o, r in zip(paths, out_leaves, ref_leaves, strict=True)]


def _compare_leaf(path: str, out: Any, ref: Any, atol: float | None, rtol: float | None) -> LeafResult:
    if not isinstance(ref, torch.Tensor):
        equal = out == ref
        return LeafResult(
            path, [], type(ref).__name__, 0.0 if equal else math.inf, 0.0 if equal else math.inf, 0.0, 0.0, equal
        )
    a, r = tolerances(ref.dtype, atol, rtol)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return LeafResult(path, list(ref.shape), str(ref.dtype), math.inf, math.inf, a, r, False)
    o64, r64 = out.detach().double().cpu(), ref.detach().double().cpu()
    finite_ref = torch.isfinite(r64)
    # Non-finite values must match eager exactly (NaN where eager has NaN).
    nonfinite_ok = torch.equal(torch.isnan(o64), torch.isnan(r64)) and torch.equal(
        o64[~finite_ref & ~torch.isnan(r64)], r64[~finite_ref & ~torch.isnan(r64)]
    )
    diff = (o64 - r64)[finite_ref]
    if not torch.isfinite(diff).all():
        nonfinite_ok = False
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ref_norm = float(r64[finite_ref].norm()) if diff.numel() else 0.0
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else (0.0 if max_abs == 0 else math.inf)
    if not nonfinite_ok:
        max_abs = rel = math.inf
    passed = nonfinite_ok and (max_abs <= a or rel <= r)
    return LeafResult(path, list(ref.shape), str(ref.dtype).removeprefix("torch."), max_abs, rel, a, r, passed)


@dataclass
class Probe:
    sizes: dict[str, int]
    leaves: list[LeafResult]

    @property
    def passed(self) -> bool:
        return all(leaf.passed for leaf in self.leaves)

    def to_json(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "passed": self.passed, "outputs": [leaf.to_json() for leaf in self.leaves]}


def verify_package(
    package: Callable[..., Any],
    module: torch.nn.Module,
    probes: list[tuple[dict[str, int], ExampleInputs]],
    atol: float | None,
    rtol: float | None,
) -> list[Probe]:
    """Run package and eager module on each probe; raise on the first mismatch."""
    results = []
    for sizes, example in probes:
        with torch.no_grad():
            ref = module(*example.args, **example.kwargs)
            out = package(*example.args, **example.kwargs)
        probe = Probe(sizes, compare_outputs(out, ref, atol, rtol))
        results.append(probe)
        for leaf in probe.leaves:
            if not leaf.passed:
                shape = sizes or "the example shape"
                raise VerifyError(
                    f"package output {leaf.path} differs from eager at {shape}: max_abs_err={leaf.max_abs_err:.3g} "
                    f"(atol {leaf.atol:g}), rel_err={leaf.rel_err:.3g} (rtol {leaf.rtol:g})"
                )
    return results
