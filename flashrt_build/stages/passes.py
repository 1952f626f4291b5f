"""Graph passes (the `passes` group), run on the module before its export so
every later stage, verification included, sees their result.

`fuse_projections`: linear layers that read the same input in one call
(attention's q/k/v, an MLP's gate/up) become one matmul over their
concatenated weights, its output split after it: a one-token decode step
launches one larger GEMM instead of two or three small ones. The fused
weight is a parameter of the layers' parent (`...self_attn.q_proj__k_proj__v_proj.weight`);
the manifest maps its rows back to the checkpoint's tensors. It runs before
a `quant` recipe, which quantizes the fused weight by its members' rule: only
layers one rule decides are fused, and only where quantizing them as one
changes no row (a scale per row, not per tensor).

`grouped_attention` (attention.py): grouped-query attention over the KV
cache as it is, not copied per query head.

`gemv` (gemv.py): the one-row matmuls of a CUDA package (a decode step's)
as a Triton GEMV compiled into it, instead of cuBLAS's GEMM kernels.

`gemv_fusion` (gemv_fusion.py): the GEMV with the RMSNorm before it,
SiLU(gate) * up before it or the residual add after it in one kernel,
rewritten in the exported graph (the export stage runs it: here, a note).

`decode_attention` (decode_attention.py): a CUDA package's one-token
attention as a Triton split-KV kernel over the cache as it is, instead of
SDPA's per-head copies and cuDNN over every cache position.

`rotary_fusion` (rotary_fusion.py): the query's rotary embedding taken into
the decode attention kernel, rewritten in the exported graph (the export
stage runs it: here, a note).

`one_kernel_attention` (decode_attention.py): that attention as one kernel a
layer, each KV head's last program merging; each attention layer gets the
count it needs, a buffer (state the package writes in place).

`combo_kernels`: Inductor's combo kernels for the methods of static shapes
on a CUDA device (a decode step), set at their compile.

`pdl` (pdl.py): the package's own kernels launched as programmatic
dependents of the kernel before them (Hopper on), set in the package's
launcher at the compile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config.schema import PASS_SWITCHES
from ..config.spec import BuildSpec
from . import pdl
from .attention import group_attention
from .decode_attention import give_counts, use_decode_attention
from .domain import preserved_buffers
from .export import calling
from .fused import FusedLinear, FusedSlice
from .gemv import use_gemv
from .inputs import make_inputs
from .progress import Stage
from .quantize import rows_kept_apart, torchao_configs

# Whether a pass rewrote anything, read from its manifest record (`passes.<switch>`,
# the export stage's rewrites merged in): one on that rewrote nothing is keyed
# as off, so its build is the build without it (cache/key.py).
REWROTE: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "fuse_projections": lambda record: bool(record["fused"]),
    "grouped_attention": lambda record: record["models"] > 0,
    "gemv": lambda record: record["layers"] > 0,
    "gemv_fusion": lambda record: bool(record["methods"]),
    "decode_attention": lambda record: record["models"] > 0,
    "rotary_fusion": lambda record: bool(record["methods"]),
    "one_kernel_attention": lambda record: record["layers"] > 0,
    "combo_kernels": lambda record: bool(record["methods"]),
    "pdl": lambda record: bool(record["launched"]),
}


def idle_passes(spec: BuildSpec, record: Mapping[str, Any]) -> frozenset[str]:
    """The switches `spec` turns on whose pass rewrote nothing, by the
    passes' record; a pass without a record is taken to have rewritten."""
    return frozenset(
        switch for switch in PASS_SWITCHES
        if getattr(spec, switch) and switch in record and not REWROTE[switch](record[switch])
    )  # fmt: skip


@dataclass(frozen=True)
class Group:
    """Linear layers (FQNs, in call order) that read one input."""

    members: tuple[str, ...]

    @property
    def parent(self) -> str:
        return self.members[0].rpartition(".")[0]

    @property
    def fused(self) -> str:
        """The fused layer's FQN: the members' own names, joined."""
        local = "__".join(m.rpartition(".")[2] for m in self.members)
        return f"{self.parent}.{local}" if self.parent else local


def passes_stage(module: nn.Module, spec: BuildSpec) -> Stage[None]:
    """Apply the config's passes to `module` in place; the manifest's `passes`."""
    section: dict[str, Any] = {"name": spec.passes}
    notes: list[str] = []
    if spec.fuse_projections:
        section["fuse_projections"] = fuse_projections(module, spec, notes)
    if spec.grouped_attention:
        switched = group_attention(module)
        notes.append(f"grouped_attention: {switched} model(s)" if switched else "grouped_attention: no grouped heads")
        section["grouped_attention"] = {"models": switched}
    if spec.gemv:  # after fusing: the fused layers take it
        layers = use_gemv(module, spec)
        int8 = sum(reads == "int8" for reads in layers.values())
        notes.append(f"gemv: {len(layers)} linear layers{f' ({int8} of int8 rows)' if int8 else ''}, for their "
                     "one-row calls" if layers else
                     f"gemv: no float linear layer on a CUDA device (target.device={spec.device})")  # fmt: skip
        section["gemv"] = {"layers": len(layers), "int8_layers": int8}
    if spec.gemv_fusion:  # the export stage rewrites the graphs and records what it fused (gemv_fusion.py): a note
        why = "passes.gemv=false" if not spec.gemv else f"target.device={spec.device}"
        cuda_gemv = spec.gemv and spec.device.startswith("cuda")
        notes.append(
            "gemv_fusion: at export, around each GEMV call"
            if cuda_gemv
            else f"gemv_fusion: no GEMV to fuse into ({why})"
        )
    if spec.decode_attention:  # after grouped_attention: its attention is the fallback
        switched = use_decode_attention(module)
        notes.append(f"decode_attention: {switched} model(s), for their one-token calls" if switched else
                     f"decode_attention: no SDPA model on a CUDA device (target.device={spec.device})")  # fmt: skip
        section["decode_attention"] = {"models": switched}
    # why rotary_fusion and one_kernel_attention find no decode attention, where they find none
    no_attention = "passes.decode_attention=false" if not spec.decode_attention else f"target.device={spec.device}"
    if spec.rotary_fusion:  # likewise (rotary_fusion.py)
        cuda = spec.decode_attention and spec.device.startswith("cuda")
        notes.append("rotary_fusion: at export, into each decode attention call" if cuda else
                     f"rotary_fusion: no decode attention to rotate in ({no_attention})")  # fmt: skip
    if spec.one_kernel_attention:  # after decode_attention: the layers it switched get their counts
        merging = give_counts(module) if spec.decode_attention else 0
        notes.append(f"one_kernel_attention: {merging} attention layers" if merging else
                     f"one_kernel_attention: no decode attention to merge in ({no_attention})")  # fmt: skip
        section["one_kernel_attention"] = {"layers": merging}
    if spec.combo_kernels:  # the compile stage sets the option (BuildSpec.method_inductor_options_of)
        methods = spec.combo_methods
        none = f"no static-shape method on a CUDA device (target.device={spec.device})"
        notes.append(f"combo_kernels: {', '.join(methods) + ' (static shapes)' if methods else none}")
        section["combo_kernels"] = {"methods": list(methods)}
    if spec.pdl:  # the compile stage patches the launcher (pdl.py)
        unavailable = pdl.unavailable(spec)
        notes.append("pdl: the package's GEMV and attention kernels as programmatic dependents"
                     if unavailable is None else f"pdl: plain launches ({unavailable})")  # fmt: skip
        section["pdl"] = {"launched": unavailable is None}
    return Stage(None, "; ".join(notes) or "none", {"passes": section} if spec.any_pass else {})


def fuse_projections(module: nn.Module, spec: BuildSpec, notes: list[str]) -> dict[str, Any]:
    """The fuse_projections pass on `module`, its log notes added to `notes`; its record."""
    groups, kept_apart = projection_groups(module, spec)
    groups, left = quantized_alike(module, groups, spec)
    left = kept_apart + left
    fused = [fuse(module, group) for group in groups]
    calls = sum(len(g.members) for g in groups)
    notes.append(f"fuse_projections: {calls} linear layers into {len(groups)} matmuls" if groups else
                 "nothing to fuse")  # fmt: skip
    if left:
        notes.append(f"{len(left)} group(s) left unfused: {left[0]['why']}")
    return {"linear_calls_cut": calls - len(groups), "fused": fused, "left": left}


def projection_groups(module: nn.Module, spec: BuildSpec) -> tuple[list[Group], list[dict[str, Any]]]:
    """The groups of `nn.Linear` layers (two or more, one parent, the same
    input size, dtype and bias, decided by one `quant` rule) that each
    method's example call feeds the very same input tensor, each layer called
    once; and the layers that read such an input but are left as they are,
    each with why: a layer a fused matmul would not reproduce (`unfaithful`)."""
    calls: list[tuple[torch.Tensor, str]] = []  # (input, layer), the inputs kept alive: ids stay unique
    names: dict[nn.Module, str] = {m: n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    why_not = {name: why for m, name in names.items() if (why := unfaithful(m)) is not None}

    def record(layer: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            calls.append((args[0], names[layer]))

    hooks = [layer.register_forward_pre_hook(record) for layer in names]
    try:
        with torch.no_grad(), preserved_buffers(module):
            for method in spec.methods:
                example = make_inputs(spec, method=method)
                with calling(module, method):
                    module(*example.args, **example.kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    times: dict[str, int] = {}
    by_input: dict[int, list[str]] = {}
    for tensor, name in calls:
        times[name] = times.get(name, 0) + 1
        by_input.setdefault(id(tensor), []).append(name)
    layers = dict(module.named_modules())
    groups, left = [], []
    for members in by_input.values():
        once = [m for m in dict.fromkeys(members) if times[m] == len(spec.methods)]
        if len(once) > 1:  # a group but for these: said, not fused
            left += [{"layers": [m], "why": f"{m} {why_not[m]}"} for m in once if m in why_not]
        for kept in _compatible([m for m in once if m not in why_not], layers, spec):
            groups.append(Group(tuple(kept)))
    return [g for g in dict.fromkeys(groups) if len(g.members) > 1], left


def unfaithful(layer: nn.Module) -> str | None:
    """Why one matmul over the group's weights would not give what `layer`'s
    own call gives (its hooks would not run; its forward is its own; its
    weight is computed), or None when it would."""
    if layer._forward_hooks or layer._forward_pre_hooks:
        return "has a forward hook or pre-hook, which a fused layer would not call"
    if type(layer).forward is not nn.Linear.forward or type(layer).__call__ is not nn.Module.__call__:
        return f"is a {type(layer).__qualname__}, which overrides nn.Linear's forward"
    if "forward" in vars(layer):
        return "has a forward of its own, set on the layer itself"
    if type(layer.weight) is not nn.Parameter:
        return f"has a weight of {type(layer.weight).__name__} (a parametrization, a tensor subclass), not a Parameter"
    if global_forward_hooks():
        return "runs under a global forward hook (register_module_forward_hook), which a fused layer would call apart"
    return None


def global_forward_hooks() -> bool:
    """Whether hooks on every module's forward are registered in this process."""
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _compatible(members: list[str], layers: dict[str, nn.Module], spec: BuildSpec) -> list[list[str]]:
    """`members` split into runs that can share one matmul (and one `quant` rule)."""
    runs: dict[tuple[Any, ...], list[str]] = {}
    for name in members:
        layer = layers[name]
        assert isinstance(layer, nn.Linear)
        rule = spec.quant.rule_for(name) if spec.quant is not None else None
        kind = (name.rpartition(".")[0], layer.in_features, layer.weight.dtype, layer.weight.device,
                layer.bias is None, rule and rule.key)  # fmt: skip
        runs.setdefault(kind, []).append(name)
    return list(runs.values())


def quantized_alike(module: nn.Module, groups: list[Group], spec: BuildSpec) -> tuple[list[Group], list[dict]]:
    """The groups whose fused weight the `quant` recipe quantizes row for row
    as it would each layer's alone, and the others, each with why."""
    if spec.quant is None:
        return groups, []
    configs = torchao_configs(spec.quant, spec.device)
    kept, left, probed = [], [], {}
    for group in groups:
        layers = [layer for m in group.members if isinstance(layer := module.get_submodule(m), nn.Linear)]
        rule = spec.quant.rule_for(group.members[0])
        config = None if rule is None else configs[rule.key]
        if config is None:  # kept float (`skip`, or no rule): fused as it is
            kept.append(group)
            continue
        assert rule is not None
        rows = [layer.out_features for layer in layers]
        key = (rule.key, tuple(rows), layers[0].weight.shape[1], layers[0].weight.dtype, layers[0].weight.device)
        if key not in probed:
            probed[key] = rows_kept_apart(config, rows, layers[0].weight)
        if probed[key] is None:
            kept.append(group)
        else:
            left.append({"layers": list(group.members), "rule": rule.key, "why": probed[key]})
    return kept, left


def fuse(module: nn.Module, group: Group) -> dict[str, Any]:
    """Replace the group's layers by views of one fused layer; its record:
    the fused weight (and bias) and the rows each original tensor holds."""
    parent = module.get_submodule(group.parent) if group.parent else module
    layers = [layer for m in group.members if isinstance(layer := module.get_submodule(m), nn.Linear)]
    rows = [layer.out_features for layer in layers]
    biases = [layer.bias.detach() for layer in layers if layer.bias is not None]
    weight = torch.cat([layer.weight.detach() for layer in layers])
    shared = FusedLinear(weight, torch.cat(biases) if biases else None, rows, group.members)
    local = group.fused.rpartition(".")[2]
    parent.add_module(local, shared)
    for index, member in enumerate(group.members):
        parent.add_module(member.rpartition(".")[2], FusedSlice(shared, index))
    parts, start = [], 0
    for member, count in zip(group.members, rows, strict=True):
        parts.append({"name": f"{member}.weight", "rows": [start, start + count]})
        start += count
    record: dict[str, Any] = {"weight": f"{group.fused}.weight", "from": parts}
    if shared.bias is not None:
        record["bias"] = f"{group.fused}.bias"
    return record
