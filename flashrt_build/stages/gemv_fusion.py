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
- `silu(g) * u` feeding a GEMV, g and u the halves of one GEMV's output (a
  fused gate/up projection): that GEMV returns silu(g) * u itself (a
  program sums a gate row and the up row below it), which the next reads
  as it is; g and u from anywhere else: the GEMV computes it block by
  block of K (each program over all of K);
- a GEMV whose one use is `r + y` (same shape and dtype): the GEMV adds r.

Only a pattern matched whole is rewritten; anything else stays as it was.
The rewritten package is verified against the eager module like any other
(whose norms round to the model's dtype where the fused kernel keeps fp32).
"""

from __future__ import annotations

import operator
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
        (x, weight, bias), scale = node.args[:3], _scale(node)
        v, eps, prologue = None, 0.0, NONE
        if (norm := _rms_norm(_unalias(x))) is not None:
            (x, v, eps), prologue = norm, NORM
        elif (gate := _silu_gate(x)) is not None:
            counts.update(gates=1)
            if (glu := _glu(program, x, *gate)) is not None:
                x = glu  # SiLU(gate) * up out of the gate/up GEMV itself: this GEMV reads it as it is
            else:
                (x, v), prologue = gate, GATED
        add, residual = _residual_add(node) or (None, None)
        if prologue == NONE and add is None:
            continue
        last = add or node  # the residual may be computed after the GEMV: the fused call stands where the add was
        args = _fused_args((x, weight, bias, v, residual, eps, prologue), scale)
        with graph.inserting_before(last):
            fused = graph.call_function(gemv_fused_op(), args)
        fused.meta = {**node.meta, "val": last.meta["val"]}
        last.replace_all_uses_with(fused)
        _renamed_output(program, last.name, fused.name)
        for gone in (add, node):
            if gone is not None:
                graph.erase_node(gone)
        counts.update(norms=int(prologue == NORM), residuals=int(add is not None))  # a bool would stay one
    if counts:
        drop_unused(graph)
        program.graph_module.recompile()
    return counts


def _scale(gemv: fx.Node) -> Any:
    """An int8 weight's scales in a `gemv` or `gemv_fused` call (their last argument), or None."""
    at = 3 if calls_op(gemv, "flashrt::gemv") else 8
    return gemv.args[at] if len(gemv.args) > at else gemv.kwargs.get("scale")


def _fused_args(args: tuple[Any, ...], scale: Any, glu: bool = False) -> tuple[Any, ...]:
    """`gemv_fused`'s arguments: `args` (x, weight, bias, v, residual, eps,
    prologue), then glu and the scales only where they are not their
    defaults (a float weight's call as it was before int8 weights took it)."""
    return (*args, glu, scale) if scale is not None else (*args, True) if glu else args


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


def _glu(program: torch.export.ExportedProgram, x: fx.Node, gate: fx.Node, up: fx.Node) -> fx.Node | None:
    """Where `x` is silu(gate) * up (`_silu_gate`) and gate and up are the
    two halves of one GEMV's output (a fused gate/up projection) that
    nothing else reads: that GEMV rewritten to return silu(gate) * up itself
    (its kernel sums a gate row and the up row below it), standing for `x`."""
    if not (calls(gate, operator.getitem) and calls(up, operator.getitem) and gate.args[0] is up.args[0]):
        return None
    split: Any = gate.args[0]  # a graph node, checked below
    g, u = gate.args[1], up.args[1]
    if (g, u) != (0, 1) or not calls(split, aten.split_with_sizes.default, aten.split.Tensor) or len(split.users) != 2:
        return None
    both: Any = split.args[0]
    sizes, dim = split.args[1], split.args[2] if len(split.args) > 2 else 0
    gv, bv = val(gate), val(both)
    if gv is None or bv is None or dim not in (-1, bv.dim() - 1):
        return None
    rows = gv.shape[-1]
    if bv.shape[-1] != 2 * rows or sizes not in (rows, [rows, rows]):
        return None
    if len(gate.users) != 1 or len(up.users) != 1 or len(both.users) != 1:
        return None
    if calls_op(both, "flashrt::gemv"):
        args = (*both.args[:3], None, None, 0.0, NONE)
    elif calls_op(both, "flashrt::gemv_fused") and both.args[4] is None and not (both.args[7:] and both.args[7]):
        args = both.args[:7]
    else:
        return None
    graph = program.graph
    with graph.inserting_before(x):
        glu = graph.call_function(gemv_fused_op(), _fused_args(args, _scale(both), glu=True))
    glu.meta = {**both.meta, "val": x.meta["val"]}
    x.replace_all_uses_with(glu)
    _renamed_output(program, x.name, glu.name)
    return glu


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
