"""The `gemv_fusion` pass: a one-token step's GEMVs with their neighbours in
one kernel, rewritten in the exported graph before the compile.

The GEMV (gemv.py) is an operator Inductor cannot fuse into, so the small
kernels around it stay launches of their own: the RMSNorm before a
projection (with the residual add before it), SiLU(gate) * up before
`down`, the residual add after `o` and `down`. This pass finds them around
each `flashrt::gemv` call of the exported program, as transformers' Llama
family traces them, and calls `flashrt::gemv_fused` in their place:

- `w * (x32 * rsqrt(mean(x32 ** 2, -1) + eps)).to(dtype)` feeding a GEMV,
  x32 an fp32 x: the GEMV reads x and normalizes it itself (each program
  sums x ** 2 over the K it reads anyway and scales its sums at the end);
- `silu(g) * u` feeding a GEMV: the GEMV computes it block by block of K;
- a GEMV whose one use is `r + y` (same shape and dtype): the GEMV adds r.

Only a pattern matched whole is rewritten; anything else stays as it was.
The rewritten package is verified against the eager module like any other
(whose norms round to the model's dtype where the fused kernel keeps fp32).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import TensorArgument

from .gemv import GATED, NONE, NORM, gemv_fused_op
from .graph_match import alike, calls, calls_op, drop_unused, val

aten = torch.ops.aten
CASTS = (aten.to.dtype, aten._to_copy.default)
FUSED = ("norms", "gates", "residuals")  # what a GEMV took in: RMSNorms, SiLU gates, residual adds


def fuse_gemv_neighbours(program: torch.export.ExportedProgram) -> Counter[str]:
    """Rewrite `program`'s GEMVs in place with their neighbours fused in;
    how many of each were: `norms`, `gates`, `residuals`."""
    graph = program.graph
    counts: Counter[str] = Counter()
    gemvs = [node for node in graph.nodes if calls_op(node, "flashrt::gemv")]
    for node in gemvs:
        x, weight, bias = node.args
        v, eps, prologue = None, 0.0, NONE
        if (norm := _rms_norm(_unalias(x))) is not None:
            (x, v, eps), prologue = norm, NORM
        elif (gate := _silu_gate(x)) is not None:
            (x, v), prologue = gate, GATED
        add, residual = _residual_add(node) or (None, None)
        if prologue == NONE and add is None:
            continue
        last = add or node  # the residual may be computed after the GEMV: the fused call stands where the add was
        with graph.inserting_before(last):
            fused = graph.call_function(gemv_fused_op(), (x, weight, bias, v, residual, eps, prologue))
        fused.meta = {**node.meta, "val": last.meta["val"]}
        last.replace_all_uses_with(fused)
        _renamed_output(program, last.name, fused.name)
        for gone in (add, node):
            if gone is not None:
                graph.erase_node(gone)
        counts.update(norms=prologue == NORM, gates=prologue == GATED, residuals=add is not None)
    if counts:
        drop_unused(graph)
        program.graph_module.recompile()
    return counts


def _renamed_output(program: torch.export.ExportedProgram, old: str, new: str) -> None:
    """The signature's outputs name graph nodes: one that named `old` names `new`."""
    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name == old:
            spec.arg = TensorArgument(name=new)


def _uncast(node: Any) -> Any:
    while calls(node, *CASTS):
        node = node.args[0]
    return node


def _unalias(node: Any) -> Any:
    while calls(node, aten.alias.default):
        node = node.args[0]
    return node


def _rms_norm(x: Any) -> tuple[fx.Node, fx.Node, float] | None:
    """(h, weight, eps) where `x` is transformers' RMSNorm of h times a 1-D weight."""
    if not calls(x, aten.mul.Tensor):
        return None
    for weight, normed in (x.args, x.args[::-1]):
        scaled, wv = _uncast(normed), val(weight)
        if not (isinstance(weight, fx.Node) and wv is not None and wv.dim() == 1):
            continue
        if not calls(scaled, aten.mul.Tensor):
            continue
        for x32, rs in (scaled.args, scaled.args[::-1]):
            eps = _variance_eps(rs, x32)
            h, xv = _uncast(x32), val(x32)
            hv = val(h)
            fp32 = xv is not None and xv.dtype == torch.float32
            if eps is not None and fp32 and hv is not None and hv.shape[-1] == wv.shape[0]:
                return h, weight, eps
    return None


def _variance_eps(rs: Any, x32: Any) -> float | None:
    """eps where `rs` is rsqrt(mean(x32 ** 2, -1, keepdim) + eps)."""
    if not calls(rs, aten.rsqrt.default) or not calls(add := rs.args[0], aten.add.Tensor):
        return None
    mean, eps = add.args
    if not (calls(mean, aten.mean.dim) and isinstance(eps, float) and len(mean.args) == 3 and mean.args[2]):
        return None
    square, dims = mean.args[0], list(mean.args[1])
    xv = val(x32)
    if xv is None or dims not in ([-1], [xv.dim() - 1]):
        return None
    if calls(square, aten.pow.Tensor_Scalar) and square.args[0] is x32 and square.args[1] == 2:
        return eps
    return None


def _silu_gate(x: Any) -> tuple[fx.Node, fx.Node] | None:
    """(g, u) where `x` is silu(g) * u, both of its shape and dtype."""
    if not calls(x, aten.mul.Tensor):
        return None
    for silu, up in (x.args, x.args[::-1]):
        if calls(silu, aten.silu.default) and alike(silu.args[0], up) and alike(up, x):
            return silu.args[0], up
    return None


def _residual_add(gemv: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(add, r) where the GEMV's one use is `add(r, y)` of its shape and dtype."""
    if len(gemv.users) != 1:
        return None
    add = next(iter(gemv.users))
    if not calls(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is gemv else add.args[0]
    if residual is gemv or not isinstance(residual, fx.Node) or not alike(residual, gemv) or not alike(add, gemv):
        return None
    return add, residual
