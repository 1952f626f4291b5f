"""How a package's outputs are compared with eager's, leaf by leaf of the
output tree: max absolute and relative error against per-dtype tolerances,
non-finite values where eager has them, constant leaves by value; a leaf
with nothing finite to compare is reported as such, never as a match."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..errors import VerifyError
from ..runtime.dtypes import DEFAULT_TOLERANCES, dtype_name

if TYPE_CHECKING:
    from ..config.spec import BuildSpec


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
    # How many values were compared: the finite ones of eager's output. Zero for
    # a non-empty tensor means nothing was compared (all NaN or Inf), not a match.
    compared: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def nothing_compared(self) -> bool:
        return self.compared == 0 and math.prod(self.shape) > 0


def tolerances(dtype: torch.dtype, atol: float | None, rtol: float | None) -> tuple[float, float]:
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype_name(dtype), (0.0, 0.0))
    return (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)


def compare_outputs(
    out: Any, ref: Any, atol: float | None, rtol: float | None, allow_nonfinite: bool = False
) -> list[LeafResult]:
    """Compare every leaf of two output trees (tuples, dicts, model outputs)."""
    out_leaves, out_spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    if out_spec != ref_spec:
        raise VerifyError(f"the package returns a different output structure: {out_spec} instead of {ref_spec}")
    return compare_leaves(out_leaves, ref, atol, rtol, allow_nonfinite)


def compare_leaves(
    out_leaves: list[Any], ref: Any, atol: float | None, rtol: float | None, allow_nonfinite: bool = False
) -> list[LeafResult]:
    """`allow_nonfinite`: a leaf eager gives as all NaN or Inf passes when the
    package gives the same; otherwise nothing could be compared, and it fails."""
    paths = [pytree.keystr(p) or "output" for p, _ in pytree.tree_flatten_with_path(ref)[0]]
    ref_leaves = pytree.tree_leaves(ref)
    leaves = [_compare_leaf(path, o, r, atol, rtol) for path, o, r in zip(paths, out_leaves, ref_leaves, strict=True)]
    for leaf in leaves:
        if leaf.nothing_compared and not allow_nonfinite:
            leaf.passed = False
    return leaves


def _compare_leaf(path: str, out: Any, ref: Any, atol: float | None, rtol: float | None) -> LeafResult:
    if not isinstance(ref, torch.Tensor):  # a constant (None, an int): the same value, or a failure
        equal = type(out) is type(ref) and bool(out == ref)
        err = 0.0 if equal else math.inf
        return LeafResult(path, [], type(ref).__name__, err, err, 0.0, 0.0, equal)
    a, r = tolerances(ref.dtype, atol, rtol)
    dtype = str(ref.dtype).removeprefix("torch.")
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
        return LeafResult(path, list(ref.shape), dtype, math.inf, math.inf, a, r, False)
    finite_errors = _errors_where_all_finite(out.detach().cpu(), ref.detach().cpu())
    if finite_errors is not None:
        max_abs, rel, count = finite_errors
        return LeafResult(path, list(ref.shape), dtype, max_abs, rel, a, r, max_abs <= a or rel <= r, count)
    o64, r64 = out.detach().double().cpu(), ref.detach().double().cpu()
    # Non-finite values must sit where eager has the same non-finite value.
    finite = torch.isfinite(r64)
    same_nonfinite = torch.equal(torch.isnan(o64), torch.isnan(r64)) and torch.equal(
        o64[torch.isinf(r64)], r64[torch.isinf(r64)]
    )
    diff = o64[finite] - r64[finite]
    if not same_nonfinite or not torch.isfinite(diff).all():
        return LeafResult(path, list(ref.shape), dtype, math.inf, math.inf, a, r, False)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ref_norm = float(r64[finite].norm()) if diff.numel() else 0.0
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return LeafResult(path, list(ref.shape), dtype, max_abs, rel, a, r, max_abs <= a or rel <= r, diff.numel())


# Elements compared at once in float64: a slice that stays in cache, where a
# whole LLM's logits converted at once would be gigabytes.
_CHUNK = 1 << 22


def _errors_where_all_finite(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int] | None:
    """(max abs error, relative error, elements) in float64, slice by slice,
    when every value of both is finite; None otherwise (a non-finite value
    makes a sum or the max non-finite), for the general comparison."""
    o, r = out.reshape(-1), ref.reshape(-1)
    max_abs, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for start in range(0, o.numel(), _CHUNK):
        r64 = r[start : start + _CHUNK].double()
        d64 = o[start : start + _CHUNK].double().sub_(r64)
        max_abs = max(max_abs, float(d64.abs().max()))
        diff_sq += float(torch.dot(d64, d64))
        ref_sq += float(torch.dot(r64, r64))
    if not all(math.isfinite(x) for x in (max_abs, diff_sq, ref_sq)):
        return None
    rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel, o.numel()


def raise_on_mismatch(leaves: list[LeafResult], where: str) -> None:
    for leaf in leaves:
        if not leaf.passed and leaf.nothing_compared:
            raise VerifyError(
                f"package output {leaf.path} has no finite values to compare at {where}: eager's is all NaN or Inf "
                "(the package's too, or it would differ); set verify.allow_nonfinite=true if that is expected"
            )
        if not leaf.passed:
            raise VerifyError(
                f"package output {leaf.path} differs from eager at {where}: max_abs_err={leaf.max_abs_err:.3g} "
                f"(verify.atol {leaf.atol:g}), rel_err={leaf.rel_err:.3g} (verify.rtol {leaf.rtol:g})"
            )


def check_replayed(spec: BuildSpec, labels: list[str], references: list[Any], result: dict[str, Any]) -> dict[str, Any]:
    """The sequence replayed from CUDA graphs (as `load(cuda_graphs=True)`
    serves it) against the plain calls and against eager."""
    worst_plain = worst_eager = 0.0
    for label, ref, plain, replayed in zip(labels, references, result["outputs"], result["replayed"], strict=True):
        where = f"{label}, replayed from a CUDA graph"
        against_eager = compare_leaves(replayed["leaves"], ref, spec.atol, spec.rtol, spec.allow_nonfinite)
        raise_on_mismatch(against_eager, where)
        plain_tree = pytree.tree_unflatten(plain["leaves"], pytree.tree_flatten(ref)[1])
        against_plain = compare_leaves(replayed["leaves"], plain_tree, spec.atol, spec.rtol, spec.allow_nonfinite)
        raise_on_mismatch(against_plain, f"{where} (against the plain call)")
        worst_eager = max([worst_eager, *(leaf.max_abs_err for leaf in against_eager)])
        worst_plain = max([worst_plain, *(leaf.max_abs_err for leaf in against_plain)])
    return {
        "passed": True,
        "calls": len(labels),
        "captured": result["graphs"],
        "max_abs_err_vs_plain": worst_plain,
        "max_abs_err_vs_eager": worst_eager,
    }


def quantization_error(
    labels: list[str], package_leaves: list[Any], float_references: list[Any], bound: float | None
) -> dict[str, Any]:
    """The package's distance from the float (unquantized) module over the
    sequence: the worst norm-wise relative error of a float output,
    ||package - float|| / ||float||, where it was, and how often the largest
    entry along the last dim (a class, a token) is the same. Past `bound`
    (quant.max_rel_error) it is an error; the record says it either way."""
    worst, where, agree, total, max_abs = 0.0, "", 0, 0, 0.0
    for label, out, ref in zip(labels, package_leaves, float_references, strict=True):
        flat = pytree.tree_flatten_with_path(ref)[0]
        for (path, r), o in zip(flat, out, strict=True):
            if not (isinstance(r, torch.Tensor) and r.is_floating_point() and isinstance(o, torch.Tensor)):
                continue
            o64, r64 = o.detach().double().cpu(), r.detach().double().cpu()
            rel = float((o64 - r64).norm() / r64.norm().clamp_min(1e-30))
            max_abs = max(max_abs, float((o64 - r64).abs().max()) if r64.numel() else 0.0)
            if rel > worst or not where:
                worst, where = rel, f"{pytree.keystr(path) or 'output'} at {label}"
            if r64.dim() >= 1 and r64.shape[-1] > 1:
                agree += int((o64.argmax(-1) == r64.argmax(-1)).sum())
                total += r64[..., 0].numel()
    record = {
        "against": "the float module (before quantization)",
        "max_rel_err": worst,
        "max_abs_err": max_abs,
        "where": where,
        "top1_agreement": agree / total if total else None,
        "bound": bound,
        "passed": bound is None or worst <= bound,
    }
    if not record["passed"]:
        raise VerifyError(
            f"quantization error against the float module: ||package - float|| / ||float|| = {worst:.4g} at {where}, "
            f"past quant.max_rel_error={bound:g}. Keep more modules unquantized (a rule with config: skip) or raise "
            "the bound if this error is acceptable"
        )
    return record
