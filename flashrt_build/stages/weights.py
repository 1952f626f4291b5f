"""The tensors a package binds: names, kinds, shapes, dtypes, digests.

The names are exactly the package's `get_constant_fqns()`; a tensor of the
exported program that the package does not bind must be an alias (a tied
weight) of one it does, otherwise the build fails instead of silently losing it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import CompileError


@dataclass
class WeightTensor:
    fqn: str  # the name the package binds
    kind: str  # parameter | buffer | constant
    tensor: torch.Tensor
    source: str  # the name in the exported program
    persistent: bool = True  # false for buffers left out of state_dict()
    aliases: list[str] = field(default_factory=list)
    # A package of several methods: the name each method's model binds it by.
    methods: dict[str, str] = field(default_factory=dict)
    # A part of a quantized weight: {"from": the weight's FQN, "part": its attribute}
    quantized: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "fqn": self.fqn,
            "shape": list(self.tensor.shape),
            "dtype": str(self.tensor.dtype).removeprefix("torch."),
            # the layout the compiled code reads it with (the sidecar holds it row-major)
            "stride": list(self.tensor.stride()),
            "kind": self.kind,
            "sha256": tensor_sha256(self.tensor),
        }
        if self.source != self.fqn:
            entry["source"] = self.source
        if not self.persistent:
            entry["persistent"] = False
        if self.aliases:
            entry["aliases"] = self.aliases
        if self.methods:
            entry["methods"] = self.methods
        if self.quantized:
            entry["quantized"] = self.quantized
        return entry


@dataclass
class InlinedTensor:
    """A constant of the forward's code compiled into the kernels, not bound."""

    source: str
    tensor: torch.Tensor

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "shape": list(self.tensor.shape),
            "dtype": str(self.tensor.dtype).removeprefix("torch."),
            "kind": "constant",
            "sha256": tensor_sha256(self.tensor),
        }


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in row-major order, whatever its device;
    read in place (no copy of a contiguous CPU tensor: a 2 GB model's
    manifest costs no second 2 GB)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


class ProgramTensor(NamedTuple):
    name: str  # as the package binds it
    kind: str  # parameter | buffer | constant
    tensor: torch.Tensor
    owner: str  # the program's own name: `name`, or the quantized weight it is a part of
    part: str | None = None  # that part's attribute (`qdata`, `scale`)


def program_tensors(
    program: torch.export.ExportedProgram, parts: Mapping[str, tuple[str, str]] | None = None
) -> list[ProgramTensor]:
    """Every parameter, buffer and lifted constant, a quantized weight (a
    tensor subclass) as the plain tensors it is made of. `parts`: those
    decompositions already unwrapped, by name: (their weight, their attribute)."""
    sig = program.graph_signature

    def value(name: str) -> torch.Tensor:
        return program.state_dict[name] if name in program.state_dict else program.constants[name]

    named = (
        [(n, "parameter") for n in sig.parameters]
        + [(n, "buffer") for n in sig.buffers]
        + [(n, "constant") for n in sig.lifted_tensor_constants]
    )
    tensors = [entry for name, kind in named for entry in _plain_parts(name, kind, value(name))]
    known = parts or {}
    return [t._replace(owner=known[t.name][0], part=known[t.name][1]) if t.name in known else t for t in tensors]


def quantized_parts(program: torch.export.ExportedProgram) -> dict[str, tuple[str, str]]:
    """The plain tensors each quantized weight of the program is made of, by
    name: (the weight's name, its attribute); kept before a decomposition
    unwraps them (`run_decompositions` binds the parts by these names alone)."""
    return {t.name: (t.owner, t.part) for t in program_tensors(program) if t.part is not None}


def _plain_parts(name: str, kind: str, tensor: torch.Tensor) -> list[ProgramTensor]:
    """A tensor subclass as AOTInductor binds it: its inner tensors, flattened
    depth first by torch's own `UnwrapTensorSubclass` and named as that
    parametrization names them (`fc.parametrizations.weight.original0`)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [ProgramTensor(name, kind, tensor, name)]
    from torch._functorch._aot_autograd.subclass_parametrization import SubclassCreationMeta, UnwrapTensorSubclass

    unwrap = UnwrapTensorSubclass()
    plain = unwrap.right_inverse(tensor)
    parts: list[str] = []

    def walk(meta: SubclassCreationMeta, path: list[str]) -> None:
        for attr, inner in meta.attrs.items():
            if isinstance(inner, SubclassCreationMeta):
                walk(inner, [*path, attr])
            else:
                parts.append(".".join([*path, attr]))

    walk(unwrap.subclass_meta, [])
    if len(parts) != len(plain) or not all(type(t) is torch.Tensor for t in plain):
        raise CompileError(f"{kind} '{name}' ({type(tensor).__name__}) holds parts that are not tensors")
    owner, _, leaf = name.rpartition(".")
    base = f"{owner}.parametrizations.{leaf}" if owner else f"parametrizations.{leaf}"
    return [
        ProgramTensor(f"{base}.original{i}", kind, t, name, part)
        for i, (part, t) in enumerate(zip(parts, plain, strict=True))
    ]


_INDUCTOR_CONSTANT = re.compile(r"^_tensor_constant(\d+)$")


def match_package_tensors(
    program: torch.export.ExportedProgram,
    package_fqns: Iterable[str],
    target: str,
    prefix: str = "",
    state: Iterable[str] = (),
    parts: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[list[WeightTensor], list[InlinedTensor], list[str]]:
    """Pair each name the package binds with its tensor in the exported program;
    also returns the code constants Inductor inlined and the names of module
    tensors the graph never reads (neither bound nor needed)."""
    # State buffers are bound apart from the weights: threaded ones are inputs
    # of the package, in-place ones constants it writes, bound to shared tensors.
    state_names = {prefix + name for name in state}
    package_fqns = [fqn for fqn in package_fqns if fqn not in state_names]
    tensors = [t for t in program_tensors(program, parts) if t.owner not in state_names]
    by_name = {t.name: t for t in tensors}
    matched = {
        fqn: WeightTensor(
            fqn,
            by_name[fqn].kind,
            by_name[fqn].tensor,
            source=fqn.removeprefix(prefix),
            quantized=None if by_name[fqn].part is None else _quantized(by_name[fqn], prefix),
        )
        for fqn in package_fqns
        if fqn in by_name
    }

    # Inductor renames lifted constants `_tensor_constant<i>`, numbered in the
    # order the exported program lists them.
    lifted = [t.name for t in tensors if t.kind == "constant" and t.name not in matched]
    for fqn in package_fqns:
        m = _INDUCTOR_CONSTANT.match(fqn)
        if fqn not in matched and m and int(m.group(1)) < len(lifted):
            source = lifted[int(m.group(1))]
            matched[fqn] = WeightTensor(fqn, "constant", by_name[source].tensor, source=source.removeprefix(prefix))
    for name in program.graph_signature.non_persistent_buffers:
        for w in matched.values():
            if w.source == name.removeprefix(prefix):
                w.persistent = False
    unknown = [fqn for fqn in package_fqns if fqn not in matched]
    if unknown:
        raise CompileError(f"the package of {target} binds tensors the exported program lacks: {unknown}")
    inlined, dropped = _unbound(program, tensors, matched, target, prefix)
    return [matched[fqn] for fqn in sorted(matched)], inlined, dropped


def _unbound(
    program: torch.export.ExportedProgram,
    tensors: list[ProgramTensor],
    matched: dict[str, WeightTensor],
    target: str,
    prefix: str,
) -> tuple[list[InlinedTensor], list[str]]:
    """The program's tensors the package does not bind: each must share
    storage with a bound one (a tied weight: recorded as its alias), be a
    constant of the forward's own code Inductor folded into the kernels (a
    one-element literal: inlined), or be read by nothing (dropped); a
    parameter or buffer the package lost is an error."""
    sources = {prefix + w.source for w in matched.values()} | {w.source for w in matched.values()}
    inlined: list[InlinedTensor] = []
    unused = unused_inputs(program)
    dropped: list[str] = []
    for name, kind, tensor, program_name, part in tensors:
        if name in sources:
            continue
        owner = next((w for w in matched.values() if _same_storage(w.tensor, tensor)), None)
        if owner is not None:  # export routes a tied weight's uses through one name
            owner.aliases.append(name.removeprefix(prefix))
        elif (program_name in unused and kind != "constant") or part is not None:
            # never read: BatchNorm's num_batches_tracked in eval, int8's all-zero zero_point
            dropped.append(name.removeprefix(prefix))
        elif kind == "constant":
            inlined.append(InlinedTensor(name.removeprefix(prefix), tensor))
        else:
            raise CompileError(
                f"the package of {target} does not bind {kind} '{name}' {list(tensor.shape)}: Inductor "
                "inlined or dropped it, so it could not be listed or replaced"
            )
    return inlined, sorted(dropped)


def _quantized(tensor: ProgramTensor, prefix: str) -> dict[str, str]:
    assert tensor.part is not None
    return {"from": tensor.owner.removeprefix(prefix), "part": tensor.part}


def union_of_methods(
    bound: Mapping[str, tuple[list[WeightTensor], list[InlinedTensor], list[str]]],
) -> tuple[list[WeightTensor], list[InlinedTensor], list[str]]:
    """The tensors several methods bind, each once: a tensor two methods read
    (the same storage) is one entry, recording the name each method binds it
    by, so the sidecar holds it once and loading binds one copy to both. A
    name two methods use for different tensors (each graph's own constants)
    is qualified with the method's name."""
    union: list[WeightTensor] = []
    for method, (tensors, _, _) in bound.items():
        for tensor in tensors:
            same = next((u for u in union if _same_storage(u.tensor, tensor.tensor)), None)
            if same is None:
                # keyed by the module's own name: a stateful method's package prefixes its FQNs
                taken = any(u.fqn == tensor.source for u in union)
                same = WeightTensor(
                    f"{method}.{tensor.source}" if taken else tensor.source,
                    tensor.kind,
                    tensor.tensor,
                    tensor.source,
                    tensor.persistent,
                    list(tensor.aliases),
                    quantized=tensor.quantized,
                )
                union.append(same)
            same.methods[method] = tensor.fqn
    inlined = [c for _, constants, _ in bound.values() for c in constants]
    never_read = set.intersection(*(set(unused) for _, _, unused in bound.values()))
    return sorted(union, key=lambda t: t.fqn), inlined, sorted(never_read)


def unused_inputs(program: torch.export.ExportedProgram) -> set[str]:
    """Parameters, buffers and constants the exported graph never reads."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    return {
        spec.target
        for spec in program.graph_signature.input_specs
        if spec.target is not None and not placeholders[spec.arg.name].users
    }


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def write_sidecar(path: Path, tensors: list[WeightTensor]) -> Path:
    """The tensors the package binds, keyed by FQN, in one safetensors file."""
    from safetensors.torch import save_file

    save_file({t.fqn: t.tensor.detach().to("cpu").contiguous() for t in tensors}, str(path))
    return path
