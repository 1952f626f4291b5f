"""The verification: the package must agree with the eager module before it is published.

The package is loaded and run in a fresh Python process, never the build
process, so a package that crashes its loader fails the build instead of
killing it. It runs a sequence of calls, the same sequence the eager module
runs in the build process: the example shape, each dynamic dim at its min, an
odd size between and its max, then a repeat chain on the example shape, so a
module that updates its own state is compared at every step.

What it is compared with is the module as the user gave it, run before any
pass or recipe rewrote it (reference.py). A quantized package is compared
with the module its recipe made, within the tolerances (a check of the
compile), and with the module as given within the recipe's own bound
(`quant.max_rel_error`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..config.spec import BuildSpec
from ..errors import VerifyError
from ..runtime.gpu import gpu_of
from ..runtime.manifest import method_bindings, state_mode
from .compare import LeafResult, check_replayed, compare_leaves, quantization_error, raise_on_mismatch
from .progress import Stage
from .quantize import Quantized
from .reference import Reference, run_eager
from .verify_process import run_package

log = logging.getLogger(__name__)


def verify_stage(
    spec: BuildSpec,
    module: torch.nn.Module,
    staging: Path,
    draft: dict[str, Any],
    state: list[str],
    reference: Reference,
    quantized: Quantized | None = None,
) -> Stage[dict[str, Any]]:
    """In a fresh process, the package loaded as users load it (digests
    checked, weights bound), against the module as given (`reference`): the
    manifest's `verification`. A quantized module (`quantized`: the float
    weights it replaced) is also compared with the module its recipe made."""
    record = verify(spec, module, staging, draft, state, reference, spec.verify_timeout, quantized)
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
    reference: Reference,
    timeout: float,
    quantized: Quantized | None = None,
) -> dict[str, Any]:
    """Compare package and eager over the whole sequence; raise on the first
    mismatch, naming the output leaf, the call, the error and the tolerance.
    `module`: as the passes and the recipe left it, holding its initial state."""
    calls = reference.calls
    with tempfile.TemporaryDirectory(prefix="flashrt-verify-") as work:  # never inside the artifact
        result = run_package(staging, manifest, calls, timeout, Path(work))
    in_place = {t["fqn"] for t in manifest["state"]["tensors"]} if state_mode(manifest) == "in_place" else set()
    for method, fqns in result["fqns"].items():
        expected = sorted(method_bindings(manifest["weights"]["tensors"], method))
        if sorted(set(fqns) - in_place) != expected:  # the state it writes in place is bound apart
            raise VerifyError(f"the package's {method} binds {sorted(fqns)}, the manifest lists {expected}")
    recipe_made = quantized is not None and bool(quantized.originals)
    if recipe_made:  # the module the recipe made, within the tolerances; the module as given is below
        references, ref_state = run_eager(module, spec, calls, state, quantized)
    else:
        references, ref_state = reference.outputs, reference.state(state, module)
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
    record["against"] = "the quantized module" if recipe_made else "the module as given"
    if recipe_made:
        assert spec.quant is not None
        labels, leaves = [c.label for c in calls], [out["leaves"] for out in result["outputs"]]
        record["quantization"] = quantization_error(labels, leaves, reference.outputs, spec.quant.max_rel_error)
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
