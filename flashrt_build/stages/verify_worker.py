"""The fresh process that loads and runs a package for verification.

    python -m flashrt_build.stages.verify_worker STAGING_DIR WORK_DIR

Reads WORK_DIR/manifest.json (the draft manifest) and WORK_DIR/calls.pt, loads
the package exactly as `flashrt_build.load` does, runs the calls in order and
writes WORK_DIR/result.pt. A crash here is reported by the build, not suffered.

On a GPU the calls run again as a serving process runs them, replayed from
CUDA graphs: once to warm up and capture (from the build's initial state),
then once more, every call a replay, whose outputs go back as `replayed`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import first_lines
from ..runtime.load import LoadedModule, graph_options, open_package
from .threads import limit_run_threads

PROGRESS = "progress"  # the step begun last: where a crash or a hang happened


def main(staging: Path, work: Path) -> None:
    limit_run_threads()
    manifest = json.loads((work / "manifest.json").read_text())
    calls = torch.load(work / "calls.pt", weights_only=False)
    (work / PROGRESS).write_text("loading")
    device = torch.device(manifest["target"]["device"])
    graphs = graph_options(manifest, device, True, None, True) if device.type == "cuda" else None
    model = open_package(staging, manifest, graphs=graphs)
    caches = {name: method.graphs for name, method in model.methods.items()}
    for method in model.methods.values():  # first as plain calls
        method.graphs = None
    outputs = run_calls(model, calls, work)
    if outputs is None:
        return
    result: dict[str, Any] = {
        "fqns": {name: model.constant_fqns(name) for name in model.methods},
        "outputs": outputs,
        "state": {name: t.detach().cpu().clone() for name, t in model.state.items()},
    }
    if graphs is not None:
        for name, method in model.methods.items():
            method.graphs = caches[name]
        for _ in range(2):  # warm-up and capture, then every call replayed
            model.reset_state()
            replayed = run_calls(model, calls, work)
            if replayed is None:
                return
        result["replayed"] = replayed
        result["graphs"] = {name: len(cache.graphs) for name, cache in caches.items() if cache is not None}
    if manifest["config"]["verify"]["bench"]:
        default = next(c for c in calls if c["method"] == model.default_method)
        result["bench"] = bench(manifest, model, default["inputs"])
    (work / PROGRESS).write_text("saving")
    torch.save(result, work / "result.pt")


def run_calls(model: LoadedModule, calls: list[dict], work: Path) -> list[dict] | None:
    """Each call's output leaves on the CPU; None once a call failed (written to result.pt)."""
    outputs = []
    with torch.no_grad():
        for index, call in enumerate(calls):  # each by its method, as users call them: state carries over
            (work / PROGRESS).write_text(f"call {index}")
            try:
                out = model.methods[call["method"]](**call["inputs"])
            except Exception as exc:  # the package's own code refused (a bounds check): say which call
                said = first_lines(exc, 1)
                torch.save(
                    {"failed": {"call": index, "error": type(exc).__name__, "message": said}}, work / "result.pt"
                )
                return None
            leaves, spec = pytree.tree_flatten(out)
            cpu = [leaf.detach().cpu().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            outputs.append({"leaves": cpu, "spec": str(spec)})
    return outputs


def bench(manifest: dict, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
    """Time the package against eager and torch.compile of the same module, here."""
    from ..config.compose import as_build_config
    from ..config.spec import resolve_spec
    from .module import instantiate_module
    from .timing import time_side_by_side

    spec = resolve_spec(as_build_config(manifest["config"]))
    eager = instantiate_module(spec)
    compiled = torch.compile(eager)
    positional, keyword = spec.default_method.call_args(inputs)
    keyword |= dict(spec.kwargs)
    return time_side_by_side(
        {
            "eager": lambda: eager(*positional, **keyword),
            "torch_compile": lambda: compiled(*positional, **keyword),
            "package": lambda: model(**inputs),
        },
        torch.device(spec.device),
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
