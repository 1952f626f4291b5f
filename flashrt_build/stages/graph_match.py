"""What the export-stage rewrites (gemv_fusion.py, rotary_fusion.py,
decode_attention.py) share to read an exported graph: which op a node
calls, its fake value, a value computed once for all its takers, and the
clean-up after a rewrite."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten


def calls(node: Any, *targets: Any) -> bool:
    """`node` calls one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def calls_op(node: Any, *names: str) -> bool:
    """`node` calls one of the custom operators `names` (`flashrt::gemv`):
    known by name, so a graph without one never defines it (it needs Triton)."""
    target = node.target if isinstance(node, fx.Node) and node.op == "call_function" else None
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in names


def val(node: Any) -> torch.Tensor | None:
    """The tensor a node computes, as export traced it (fake), else None."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def alike(a: Any, b: Any) -> bool:
    """Both nodes compute tensors of one shape and dtype."""
    va, vb = val(a), val(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype


def drop_unused(graph: fx.Graph) -> None:
    """Remove what a rewrite left unused: dead nodes, and the metadata
    asserts (side effects to fx) that were their only use."""
    changed = True
    while changed:
        changed = False
        for node in list(reversed(graph.nodes)):
            users = list(node.users)
            if node.op != "call_function" or not users or node.is_impure():
                continue
            if all(calls(user, aten._assert_tensor_metadata.default) for user in users):
                for user in users:
                    graph.erase_node(user)
                changed = True
        changed = graph.eliminate_dead_code() or changed


def computed_once(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """A node that is `node` itself (an identity `as_strided` of it), which
    Inductor computes into one buffer however many operators take it; None
    where `node`'s layout is not static.

    Inductor inlines a cheap pointwise value into each of its takers, and
    one an operator takes (a custom op, a Triton kernel) it computes into a
    buffer of that taker's own: a kernel per taker. `as_strided` needs its
    input in memory, with eager's strides (Inductor's lowering realizes it):
    its takers then read that one buffer."""
    value = val(node)
    if value is None or not all(isinstance(n, int) for n in (*value.shape, *value.stride(), value.storage_offset())):
        return None
    with graph.inserting_after(node):
        once = graph.call_function(
            aten.as_strided.default, (node, list(value.shape), list(value.stride()), value.storage_offset())
        )
    once.meta = {**node.meta, "val": value.as_strided(value.shape, value.stride(), value.storage_offset())}
    return once
