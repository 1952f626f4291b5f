"""cuBLAS's int8 matmul (`aten._int_mm` on CUDA) refuses 16 rows or fewer,
and a recipe that quantizes activations (`int8_dq_prefill`) calls it with a
prompt's rows, as few as the prompt's shortest length. On a CUDA target
each call gets 16 rows of zeros more and its result is cut back to the
rows it was given: the same product at any length, for an int8 copy of the
activations (small beside the weights every call reads).

The int8 matmul comes in two forms: `aten._int_mm`, or, where torchao sees
a tracer (export on a CUDA device), `out_dtype(aten.mm, int32, a, b)`, which
Inductor lowers to `aten._int_mm` after this pass could see it. Both are
padded."""

from __future__ import annotations

from typing import Any

import torch
from torch._higher_order_ops.out_dtype import out_dtype

PAD = 16  # rows: cuBLAS takes more than 16


def pad_int8_matmuls(program: torch.export.ExportedProgram, device: str) -> tuple[torch.export.ExportedProgram, int]:
    """The program with each int8 matmul padded (a CUDA target), and how many were."""
    calls = sum(_is_int8_matmul(node) for node in program.graph.nodes)
    if not calls or not device.startswith("cuda"):
        return program, 0
    inside: list[bool] = []

    def padded(a: torch.Tensor, b: torch.Tensor) -> Any:
        if inside:  # the padded call itself: traced as it is
            return NotImplemented
        inside.append(True)
        try:
            return torch.ops.aten._int_mm(torch.nn.functional.pad(a, (0, 0, 0, PAD)), b)[: a.shape[0]]
        finally:
            inside.pop()

    def padded_out_dtype(op: Any, dtype: torch.dtype, *args: torch.Tensor) -> Any:
        # another out_dtype call: traced as it is
        return padded(*args) if _int8_mm(op, dtype, [a.dtype for a in args]) else NotImplemented

    table = {torch.ops.aten._int_mm.default: padded, out_dtype: padded_out_dtype}
    return program.run_decompositions(table), calls


def _is_int8_matmul(node: torch.fx.Node) -> bool:
    if node.target is torch.ops.aten._int_mm.default:
        return True
    if node.target is not out_dtype or not all(isinstance(a, torch.fx.Node) for a in node.args[2:]):
        return False
    return _int8_mm(node.args[0], node.args[1], [a.meta["val"].dtype for a in node.args[2:]])  # type: ignore[union-attr]


def _int8_mm(op: Any, dtype: Any, operands: list[torch.dtype]) -> bool:
    """`out_dtype(op, dtype, *operands)` is an int8 matmul: mm into int32 of two int8 operands."""
    return op is torch.ops.aten.mm.default and dtype == torch.int32 and operands == [torch.int8, torch.int8]
