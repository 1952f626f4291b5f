"""The package as built: the tensors it binds (every one named, shaped and
digested, the sidecar written for external weights), the state a stateful
module writes, the files served beside it, and the package sealed with the
record of what a load relies on (archive.py)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..artifact import PACKAGE, SIDECAR, STATE
from ..config.schema import WeightsMode
from ..config.spec import BuildSpec
from ..runtime.contract import load_contract
from ..runtime.dtypes import dtype_name
from ..runtime.hashing import file_record
from .archive import package_constant_fqns, seal_package
from .compile import method_options
from .export import Exported
from .progress import Stage
from .weights import match_package_tensors, tensor_sha256, union_of_methods, write_sidecar


def package_stage(
    spec: BuildSpec,
    module: torch.nn.Module,
    exported: list[Exported],
    compiled: Mapping[str, bool],
    method_keys: Mapping[str, str],
    toolchain: Mapping[str, Any],
    staging: Path,
) -> Stage[list[str]]:
    """What the package binds and takes, as manifest sections; the package
    sealed with the part of them a load relies on. Its value: the state
    buffers the methods write (verification compares them)."""
    package_path = staging / PACKAGE
    stateful = sorted({name for e in exported for name in e.state})
    threaded = any(e.threaded for e in exported)
    weights, bound, inlined = _weights_section(spec, exported, stateful, staging)
    default = next(e for e in exported if e.method == spec.default_method)
    sections: dict[str, Any] = {
        "weights": weights,
        "state": write_state(staging, module, stateful, threaded),
        # the default method's (what m(...) calls); every method's under `methods`
        "inputs": [inp.to_json() for inp in default.method.inputs],
        "outputs": output_specs(default),
        "methods": {e.method.name: _method_section(spec, e, compiled, method_keys) for e in exported},
        "target": {"device": spec.device, "dtype": spec.dtype, "tf32": spec.tf32},
        "toolchain": dict(toolchain),
    }
    reused = all(compiled.values())
    # A lone method's package comes from the store whole, sealed; several
    # methods' stored models are combined into a fresh one, sealed here.
    seal_package(package_path, load_contract(sections), already=reused and not spec.multi_method)
    sections["package"] = {"file": PACKAGE, **file_record(package_path), "reused": reused}
    sections["files"] = copy_served_files(spec, staging)
    note = f"{sections['package']['bytes'] / 1e6:.2f} MB, {bound} tensors bound"
    if spec.weights is WeightsMode.external:
        note += f", sidecar {weights['bytes'] / 1e6:.2f} MB"
    if inlined:
        note += f", {inlined} code constants inlined"
    if stateful:
        note += f", state {'threaded' if threaded else 'in place'} ({sections['state']['bytes'] / 1e6:.2f} MB)"
    return Stage(stateful, note, sections)


def _weights_section(
    spec: BuildSpec, exported: list[Exported], stateful: list[str], staging: Path
) -> tuple[dict[str, Any], int, int]:
    """The manifest's `weights`: every tensor the package binds (the sidecar
    written for external weights), and how many are bound and inlined."""
    bound = {
        # In place, every method binds the shared state (one that only reads it too), not a weight's copy.
        e.method.name: match_package_tensors(
            e.program,
            package_constant_fqns(staging / PACKAGE, e.method.model),
            spec.target,
            e.prefix,
            e.state if e.threaded else stateful,
            e.parts,
        )
        for e in exported
    }
    tensors, inlined, unused = union_of_methods(bound) if spec.multi_method else bound[spec.default_method.name]
    weights: dict[str, Any] = {"mode": spec.weights.value, "file": None, "sha256": None}
    if spec.weights is WeightsMode.external:
        weights.update(file=SIDECAR, **file_record(write_sidecar(staging / SIDECAR, tensors)))
    elif spec.multi_method:
        weights["copies"] = len(spec.methods)  # each method's model holds its own
    weights["tensors"] = [t.to_json() for t in tensors]
    weights["inlined"] = [t.to_json() for t in inlined]  # constants Inductor compiled into the kernels
    weights["unused"] = unused  # module tensors the graph never reads: accepted in a checkpoint, not bound
    return weights, len(tensors), len(inlined)


def _method_section(
    spec: BuildSpec, e: Exported, compiled: Mapping[str, bool], method_keys: Mapping[str, str]
) -> dict[str, Any]:
    """One method's entry of the manifest's `methods`."""
    return {
        "method": e.method.attr,
        "model": e.method.model,
        "inputs": [inp.to_json() for inp in e.method.inputs],
        "outputs": output_specs(e),
        "kwargs": dict(e.method.kwargs),
        "state": e.state,
        "inductor_options": method_options(e, spec),
        "compiled": "reused" if compiled[e.method.name] else "built",
        **({"method_key": method_keys[e.method.name]} if spec.multi_method else {}),
    }


def copy_served_files(spec: BuildSpec, staging: Path) -> list[dict[str, Any]]:
    """`module.files` copied beside the package (a tokenizer), each recorded
    as the manifest records the package: name, digest, size."""
    records = []
    for served in (f for f in spec.input_files if f.key == "module.files"):
        shutil.copyfile(served.path, staging / served.name)
        records.append({"file": served.name, **file_record(staging / served.name)})
    return records


def write_state(staging: Path, module: torch.nn.Module, names: list[str], threaded: bool) -> dict[str, Any] | None:
    """The initial values of the state buffers, beside the package, and how
    the package keeps them: in place (written where they are bound, never
    copied) or threaded (each call copies them into the graph and back)."""
    if not names:
        return None
    tensors = {name: module.get_buffer(name).detach().to("cpu").contiguous().clone() for name in names}
    path = staging / STATE
    save_file(tensors, str(path))
    size = sum(t.nbytes for t in tensors.values())
    return {
        "file": STATE,
        **file_record(path),
        "mode": "threaded" if threaded else "in_place",
        "state_bytes": size,
        # the bytes a call moves to keep the state: a copy into the graph and one back
        "copied_bytes_per_call": 2 * size if threaded else 0,
        "tensors": [
            {"fqn": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_sha256(t)}
            for n, t in tensors.items()
        ],
    }


def output_specs(exported: Exported) -> list[dict[str, Any]]:
    """Shape and dtype of each flattened output of a method, dynamic dims by their names."""
    program, state = exported.program, len(exported.state) if exported.threaded else 0
    names: dict[Any, str] = {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for inp in exported.method.inputs:
        node = placeholders.get(inp.name)
        if node is None:
            continue
        for axis, dim in inp.dynamic.items():
            size = node.meta["val"].shape[axis]
            if isinstance(size, torch.SymInt):
                names[size.node.expr] = dim.name
    output = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = output.args[0][: len(output.args[0]) - state]  # threaded state comes last
    specs: list[dict[str, Any]] = []
    for node in user_outputs:
        if not isinstance(node, torch.fx.Node):  # a constant the method returns (None, 3): the package gives it back
            value = node if isinstance(node, (bool, int, float, str, type(None))) else repr(node)
            specs.append({"shape": None, "dtype": type(node).__name__, "value": value})
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            specs.append({"shape": None, "dtype": type(val).__name__})
            continue
        shape = []
        for size in val.shape:
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                shape.append(str(expr.subs({s: _symbol(names[s]) for s in expr.free_symbols if s in names})))
            else:
                shape.append(int(size))
        specs.append({"shape": shape, "dtype": str(val.dtype).removeprefix("torch.")})
    return specs


def _symbol(name: str) -> Any:
    import sympy

    return sympy.Symbol(name)
