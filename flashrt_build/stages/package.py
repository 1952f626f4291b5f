"""Stage 5: the package as built: the tensors it binds (every one named,
shaped and digested, the sidecar written for external weights), the state
a stateful module threads, and the package sealed with the record of what a
load relies on. Also the archive plumbing: the FQNs a model binds, read from
its source; several methods' models combined into one .pt2."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..artifact import PACKAGE, SIDECAR, STATE
from ..config.schema import WeightsMode
from ..config.spec import BuildSpec
from ..errors import CompileError
from ..runtime.contract import CONTRACT_MEMBER, load_contract, read_contract
from ..runtime.dtypes import dtype_name
from ..runtime.hashing import file_record
from .compile import method_options
from .export import Exported, output_specs
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
    bound = {
        # In place, every method binds the shared state (one that only reads it too), not a weight's copy.
        e.method.name: match_package_tensors(
            e.program,
            package_constant_fqns(package_path, e.method.model),
            spec.target,
            e.prefix,
            e.state if e.threaded else stateful,
        )
        for e in exported
    }
    tensors, inlined, unused = union_of_methods(bound) if spec.multi_method else bound[spec.default_method.name]
    weights: dict[str, Any] = {"mode": spec.weights.value, "file": None, "sha256": None}
    if spec.weights is WeightsMode.external:
        weights.update(file=SIDECAR, **file_record(write_sidecar(staging / SIDECAR, tensors)))
    elif spec.multi_method:
        weights["copies"] = len(spec.methods)  # each method's model holds its own
    default = next(e for e in exported if e.method == spec.default_method)
    sections: dict[str, Any] = {
        "weights": {
            **weights,
            "tensors": [t.to_json() for t in tensors],
            # constants of the forward's code that Inductor compiled into the kernels
            "inlined": [t.to_json() for t in inlined],
            # module tensors the graph never reads: accepted in a checkpoint, not bound
            "unused": unused,
        },
        "state": write_state(staging, module, stateful, threaded),
        # the default method's (what m(...) calls); every method's under `methods`
        "inputs": [inp.to_json() for inp in default.method.inputs],
        "outputs": output_specs(default),
        "methods": {
            e.method.name: {
                "method": e.method.attr,
                "model": e.method.model,
                "inputs": [inp.to_json() for inp in e.method.inputs],
                "outputs": output_specs(e),
                "kwargs": dict(e.method.kwargs),
                "state": e.state,
                "inductor_options": method_options(e, spec.method_inductor_options),
                "compiled": "reused" if compiled[e.method.name] else "built",
                **({"method_key": method_keys[e.method.name]} if spec.multi_method else {}),
            }
            for e in exported
        },
        "target": {"device": spec.device, "dtype": spec.dtype, "tf32": spec.tf32},
        "toolchain": dict(toolchain),
    }
    reused = all(compiled.values())
    # A lone method's package comes from the store whole, sealed; several
    # methods' stored models are combined into a fresh one, sealed here.
    seal_package(package_path, load_contract(sections), already=reused and not spec.multi_method)
    sections["package"] = {"file": PACKAGE, **file_record(package_path), "reused": reused}
    sections["files"] = copy_served_files(spec, staging)
    note = f"{sections['package']['bytes'] / 1e6:.2f} MB, {len(tensors)} tensors bound"
    if spec.weights is WeightsMode.external:
        note += f", sidecar {weights['bytes'] / 1e6:.2f} MB"
    if inlined:
        note += f", {len(inlined)} code constants inlined"
    if stateful:
        note += f", state {'threaded' if threaded else 'in place'} ({sections['state']['bytes'] / 1e6:.2f} MB)"
    return Stage(stateful, note, sections)


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


def seal_package(package_path: Path, contract: Mapping[str, Any], already: bool = False) -> None:
    """Record what a load relies on inside the package (`CONTRACT_MEMBER`),
    whose digest the manifest records, so an edited manifest is refused. A
    package reused from the store (`already`) carries it: it must agree."""
    if already:
        if read_contract(package_path) != contract:
            raise CompileError(f"the stored package {package_path} was built for another contract; clean the store")
        return
    with zipfile.ZipFile(package_path, "a") as archive:
        folder = archive.namelist()[0].partition("/")[0]
        # fixed metadata and order: a release build stays byte-for-byte reproducible
        member = zipfile.ZipInfo(f"{folder}/{CONTRACT_MEMBER}", date_time=(1980, 1, 1, 0, 0, 0))
        archive.writestr(member, json.dumps(contract, sort_keys=True, separators=(",", ":")))


# Where a model's compiled files live inside a .pt2 archive.
_MODEL_DIR = re.compile(r"^[^/]+/data/aotinductor/([^/]+)/([^/]+)$")
# What an AOTInductor package holds besides its models' files.
_ARCHIVE_RECORDS = {
    "archive_format",
    "archive_version",
    ".data/version",
    "byteorder",
    ".data/serialization_id",
    CONTRACT_MEMBER,
}


def package_constant_fqns(path: Path, model: str | None = None) -> list[str]:
    """The FQNs a package's model binds, read from its generated wrapper
    source, so the build process never runs package code. The verifier
    cross-checks them against `get_constant_fqns()` in a fresh process."""
    with zipfile.ZipFile(path) as archive:
        wrappers = [
            n
            for n in archive.namelist()
            if n.endswith(".wrapper.cpp") and (model is None or f"/data/aotinductor/{model}/" in n)
        ]
        if len(wrappers) != 1:
            raise CompileError(f"{path} holds {len(wrappers)} wrapper sources for model {model}; expected one")
        source = archive.read(wrappers[0]).decode()
    return re.findall(r'constants_info_\[\d+\]\.original_fqn = "([^"]*)";', source)


def combine_packages(parts: Mapping[str, Path], package_path: Path) -> Path:
    """One .pt2 holding each single-model package of `parts` as the model of
    that name, the layout AOTInductor loads a model from by name. Each part
    was compiled (and is cached) on its own, so changing one method's inputs
    recompiles that method only."""
    from torch._inductor.package import package_aoti

    with tempfile.TemporaryDirectory(prefix="flashrt-combine-") as scratch:
        files: dict[str, list[str]] = {}
        for name, part in parts.items():
            folder = Path(scratch) / name
            folder.mkdir()
            with zipfile.ZipFile(part) as archive:
                for member in sorted(archive.namelist()):
                    found = _MODEL_DIR.match(member)
                    if found is None:
                        if member.partition("/")[2] not in _ARCHIVE_RECORDS:
                            raise CompileError(f"{part} holds {member}, which flashrt_build cannot combine")
                        continue
                    (folder / found.group(2)).write_bytes(archive.read(member))
                    files.setdefault(name, []).append(str(folder / found.group(2)))
        package_aoti(str(package_path), files)
    return package_path
