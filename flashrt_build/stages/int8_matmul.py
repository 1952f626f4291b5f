"""cuBLAS's int8 matmul (`aten._int_mm` on CUDA) refuses 16 rows or fewer,
and a recipe that quantizes activations (`int8_dq_prefill`) calls it with a
prompt's rows, as few as the prompt's shortest length. On a CUDA target
each call gets 16 rows of zeros more and its result is cut back to the
rows it was given: the same product at any length, for an int8 copy of the
activations (small beside the weights every call reads)."""

from __future__ import annotations

import torch

PAD = 16  # rows: cuBLAS takes more than 16


def pad_int8_matmuls(program: torch.export.ExportedProgram, device: str) -> tuple[torch.export.ExportedProgram, int]:
    """The program with each `aten._int_mm` padded (a CUDA target), and how many were."""
    calls = sum(node.target is torch.ops.aten._int_mm.default for node in program.graph.nodes)
    if not calls or not device.startswith("cuda"):
        return program, 0
    inside: list[bool] = []

    def padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if inside:  # the padded call itself: traced as it is
            return NotImplemented
        inside.append(True)
        try:
            return torch.ops.aten._int_mm(torch.nn.functional.pad(a, (0, 0, 0, PAD)), b)[: a.shape[0]]
        finally:
            inside.pop()

    return program.run_decompositions({torch.ops.aten._int_mm.default: padded}), calls
