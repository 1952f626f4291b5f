"""The `rotary_fusion` pass: a one-token step's rotary embedding of the
query taken into the decode attention kernel, rewritten in the exported
graph before the compile.

The rotary embedding of q before `flashrt::decode_attention`
(decode_attention.py) is a kernel of its own in every layer, reading q and
writing it back rotated for the attention kernel to read again. The
attention kernel loads q anyway: this pass finds, in the exported program,

    q * cos + cat(-q[..., d/2:], q[..., :d/2]) * sin

(transformers' `apply_rotary_pos_emb`, `rotate_half`) as the query of a
decode_attention call and gives the call q, cos and sin instead: the kernel
rotates q as it loads it, in fp32 (eager rounds the rotated q to its dtype).
k's rotary stays where it is: it feeds the cache write, with which
Inductor fuses it.

Only the whole pattern on the call's own query is rewritten; anything
else stays as it was, and the package is verified against eager as always.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import fx

from .decode_attention import OPS as ATTENTION
from .graph_match import alike, calls, calls_op, drop_unused, val

aten = torch.ops.aten


def fuse_rotary(program: torch.export.ExportedProgram) -> int:
    """Rewrite `program`'s decode_attention calls in place to rotate their
    query themselves; how many were."""
    graph = program.graph
    fused = 0
    for node in graph.nodes:
        # a call as the attention makes it: no tables yet (left out, or None before one_kernel_attention's counts)
        plain = all(table is None for table in node.args[5:7])
        if not calls_op(node, *ATTENTION) or not plain or node.kwargs:
            continue
        found = _rotary(node.args[0])
        if found is None:
            continue
        q, cos, sin = found
        node.args = (q, *node.args[1:5], cos, sin, *node.args[7:])
        fused += 1
    if fused:
        drop_unused(graph)
        program.graph_module.recompile()
    return fused


def _rotary(x: Any) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(q, cos, sin) where `x` is q * cos + rotate_half(q) * sin, q a
    (batch, heads, 1, dim) query and cos, sin tables of one row a batch."""
    if not calls(x, aten.add.Tensor) or len(x.args) != 2 or x.kwargs:
        return None
    for straight, rotated in (x.args, x.args[::-1]):
        if not (calls(straight, aten.mul.Tensor) and calls(rotated, aten.mul.Tensor)):
            continue
        for q, cos in (straight.args, straight.args[::-1]):
            for half, sin in (rotated.args, rotated.args[::-1]):
                rotates_q = isinstance(q, fx.Node) and _rotated_half_of(half) is q and alike(q, x)
                if rotates_q and _table(cos, q) and _table(sin, q):
                    return q, cos, sin
    return None


def _rotated_half_of(node: Any) -> fx.Node | None:
    """q where `node` is cat(-q[..., d/2:], q[..., :d/2], -1)."""
    if not calls(node, aten.cat.default) or len(node.args) != 2 or not _last_dim(node, node.args[1]):
        return None
    parts = node.args[0]
    if len(parts) != 2 or not calls(parts[0], aten.neg.default):
        return None
    upper, lower = parts[0].args[0], parts[1]
    if not (calls(upper, aten.slice.Tensor) and calls(lower, aten.slice.Tensor)):
        return None
    q = upper.args[0]
    qv = val(q)
    if lower.args[0] is not q or qv is None or qv.shape[-1] % 2:
        return None
    dim, half = qv.shape[-1], qv.shape[-1] // 2
    if _slice(upper, q) == (half, dim) and _slice(lower, q) == (0, half):
        return q
    return None


def _slice(node: fx.Node, q: fx.Node) -> tuple[int, int] | None:
    """(start, end) of a slice of q's last dimension, step 1, end clipped to its size."""
    args: list[Any] = [*node.args, None, None, None, None][:5]
    _, dim, start, end, step = args
    qv = val(q)
    if qv is None or not _last_dim(q, 0 if dim is None else dim) or step not in (None, 1):
        return None
    start, end = 0 if start is None else start, sys.maxsize if end is None else end
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    return start, min(end, qv.shape[-1])


def _last_dim(node: Any, dim: Any) -> bool:
    nv = val(node)
    return nv is not None and isinstance(dim, int) and dim in (-1, nv.dim() - 1)


def _table(table: Any, q: fx.Node) -> bool:
    """A cos or sin table for q: (batch or 1, 1, 1, dim) of a float dtype."""
    tv, qv = val(table), val(q)
    if tv is None or qv is None or qv.dim() != 4 or qv.shape[2] != 1 or tv.dim() != 4:
        return False
    return tv.shape[0] in (1, qv.shape[0]) and tuple(tv.shape[1:]) == (1, 1, qv.shape[-1]) and tv.is_floating_point()
