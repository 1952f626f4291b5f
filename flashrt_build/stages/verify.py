"""The verification: the package must agree with the eager module before it is published.

The package is loaded and run in a fresh Python process, never the build
process, so a package that crashes its loader fails the build instead of
killing it. It runs a sequence of calls, the same sequence the eager module
runs in the build process: the example shape, each dynamic dim at its min, an
odd size between and its max, then a repeat chain on the example shape, so a
module that updates its own state is compared at every step.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..config.spec import BuildSpec
from ..errors import VerifyError, first_lines
from ..runtime.gpu import gpu_of
from ..runtime.manifest import method_bindings, state_mode
from .compare import LeafResult, check_replayed, compare_leaves, quantization_error, raise_on_mismatch
from .inputs import make_inputs
from .progress import Stage
from .quantize import Quantized, swapped_weights
from .verify_process import Call, run_package

log = logging.getLogger(__name__)


def plan_calls(spec: BuildSpec, repeat: int) -> list[Call]:
    """For each method: the example, each dim at min / an odd size between /
    max. Then a chain: a lone forward `repeat` more times; several methods
    each once in the order listed, then the last one `repeat` more times, the
    way a user calls them (prefill, then decode steps)."""
    calls = []
    for method in spec.methods:
        probes: list[dict[str, int]] = [{}]
        dims = {d.name: d for inp in method.inputs for d in inp.dynamic.values()}
        for dim in dims.values():
            for size in (dim.min, _odd_between(dim.min, dim.max), dim.max):
                if size is not None and {dim.name: size} not in probes:
                    probes.append({dim.name: size})
        prefix = f"{method.name}: " if method.label else ""
        calls += [Call(prefix + _label(sizes), sizes, {}, method) for sizes in probes]
    if spec.multi_method:
        chain = [*spec.methods, *[spec.methods[-1]] * repeat]
        calls += [Call(f"chain {i + 1}: {m.name}", {}, {}, m) for i, m in enumerate(chain)]
    else:
        calls += [Call(f"repeat {i + 1}", {}, {}, spec.default_method) for i in range(repeat)]
    for i, call in enumerate(calls):
        example = make_inputs(spec, seed=spec.seed + 1 + i, sizes=call.sizes, method=call.method)
        call.inputs = example.named(call.method)
    return calls


def _odd_between(lo: int, hi: int) -> int | None:
    mid = (lo + hi) // 2
    mid = mid if mid % 2 else mid + 1
    return mid if lo < mid < hi else None


def _label(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "example"


def run_eager(
    module: torch.nn.Module, spec: BuildSpec, calls: list[Call], state: list[str], quantized: Quantized | None = None
) -> tuple[list[Any], dict]:
    """The reference outputs of the sequence, and the module's state after it;
    each call with its method's own weights where a recipe gives it some."""
    outputs = []
    with torch.no_grad():
        for call in calls:
            method = call.method
            args, kwargs = method.call_args(call.inputs)
            try:
                with swapped_weights(module, quantized.methods.get(method.name, {}) if quantized else {}):
                    out = getattr(module, method.attr)(*args, **kwargs, **method.kwargs)
            except Exception as exc:
                raise VerifyError(
                    f"the eager {method.attr} of {spec.target} raised {type(exc).__name__} at call '{call.label}', "
                    f"so there is nothing to compare the package with: {first_lines(exc, 2)}"
                ) from exc
            outputs.append(
                pytree.tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, out)
            )
    return outputs, {name: module.get_buffer(name).detach().cpu().clone() for name in state}


def verify_stage(
    spec: BuildSpec,
    module: torch.nn.Module,
    staging: Path,
    draft: dict[str, Any],
    state: list[str],
    quantized: Quantized | None = None,
) -> Stage[dict[str, Any]]:
    """In a fresh process, the package loaded as users load it (digests
    checked, weights bound), against eager: the manifest's `verification`.
    A quantized module (`quantized`: the float weights it replaced) is also
    compared as it was before quantization."""
    record = verify(spec, module, staging, draft, state, spec.repeat, spec.verify_timeout, quantized)
    record["gpu"] = gpu_of(spec.device)  # the worker runs on the build's device
    note = f"{len(record['probes'])} calls in a fresh process passed"
    if "quantization" in record:
        q = record["quantization"]
        agreement = "" if q["top1_agreement"] is None else f", top-1 agreement {q['top1_agreement']:.1%}"
        note += f"; against the float module rel err {q['max_rel_err']:.3g}{agreement}"
    if "bench" in record:
        note += "; median ms " + ", ".join(f"{k} {v['median']:.3f}" for k, v in record["bench"]["ms"].items())
    return Stage(record, note, {"verification": record})


def verify(
    spec: BuildSpec,
    module: torch.nn.Module,
    staging: Path,
    manifest: dict[str, Any],
    state: list[str],
    repeat: int,
    timeout: float,
    quantized: Quantized | None = None,
) -> dict[str, Any]:
    """Compare package and eager over the whole sequence; raise on the first
    mismatch, naming the output leaf, the call, the error and the tolerance."""
    calls = plan_calls(spec, repeat)
    with tempfile.TemporaryDirectory(prefix="flashrt-verify-") as work:  # never inside the artifact
        result = run_package(staging, manifest, calls, timeout, Path(work))
    in_place = {t["fqn"] for t in manifest["state"]["tensors"]} if state_mode(manifest) == "in_place" else set()
    for method, fqns in result["fqns"].items():
        expected = sorted(method_bindings(manifest["weights"]["tensors"], method))
        if sorted(set(fqns) - in_place) != expected:  # the state it writes in place is bound apart
            raise VerifyError(f"the package's {method} binds {sorted(fqns)}, the manifest lists {expected}")
    float_references = None
    if quantized and quantized.originals:  # first, from the state the package started with
        initial = {name: module.get_buffer(name).detach().clone() for name in state}
        with swapped_weights(module, quantized.originals):
            float_references, _ = run_eager(module, spec, calls, state)
        for name, value in initial.items():
            module.get_buffer(name).copy_(value)
    references, ref_state = run_eager(module, spec, calls, state, quantized)
    probes = []
    for call, ref, out in zip(calls, references, result["outputs"], strict=True):
        if out["spec"] != str(pytree.tree_flatten(ref)[1]):
            raise VerifyError(f"the package returns a different output structure at {call.label}: {out['spec']}")
        leaves = compare_leaves(out["leaves"], ref, spec.atol, spec.rtol, spec.allow_nonfinite)
        probes.append({"label": call.label, "sizes": call.sizes, "outputs": leaves})
        raise_on_mismatch(leaves, call.label)
    state_leaves = compare_leaves(
        [result["state"][n] for n in state], [ref_state[n] for n in state], spec.atol, spec.rtol, spec.allow_nonfinite
    )
    for leaf, name in zip(state_leaves, state, strict=True):
        leaf.path = f"state.{name}"
    raise_on_mismatch(state_leaves, f"the end of the sequence ({len(calls)} calls)")
    record = _verification_record(probes, state_leaves, spec)
    if float_references is not None:
        assert spec.quant is not None
        labels, leaves = [c.label for c in calls], [out["leaves"] for out in result["outputs"]]
        record["quantization"] = quantization_error(labels, leaves, float_references, spec.quant.max_rel_error)
    if "replayed" in result:
        record["graphs"] = check_replayed(spec, [c.label for c in calls], references, result)
    if "bench" in result:
        record["bench"] = result["bench"]
    return record


def _verification_record(probes: list[dict[str, Any]], state: list[LeafResult], spec: BuildSpec) -> dict[str, Any]:
    """Every call's leaves, plus the worst errors per leaf over all calls."""
    worst: dict[str, dict[str, float]] = {}
    for probe in probes:
        for leaf in probe["outputs"]:
            w = worst.setdefault(leaf.path, {"max_abs_err": 0.0, "rel_err": 0.0, "atol": leaf.atol, "rtol": leaf.rtol})
            w["max_abs_err"] = max(w["max_abs_err"], leaf.max_abs_err)
            w["rel_err"] = max(w["rel_err"], leaf.rel_err)
    return {
        "enabled": True,
        "passed": True,
        "process": "fresh",
        "atol": spec.atol,
        "rtol": spec.rtol,
        "outputs": [{"path": path, **errs} for path, errs in worst.items()],
        "state": [leaf.to_json() for leaf in state],
        "probes": [
            {"label": p["label"], "sizes": p["sizes"], "passed": True, "outputs": [x.to_json() for x in p["outputs"]]}
            for p in probes
        ],
    }
