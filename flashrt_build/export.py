"""Stage 4: capture the module as one graph with torch.export.

A graph break or any export failure is an error naming the module target and
torch's reason. There is no fallback to a partial graph or to eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .errors import ExportError, first_lines
from .inputs import ExampleInputs
from .spec import BuildSpec

_exporting = False


def is_exporting() -> bool:
    """True while flashrt_build traces a module, so model code can step
    Python-side bookkeeping (counters, caches, logging) aside."""
    return _exporting or torch.compiler.is_exporting()


@contextlib.contextmanager
def _exporting_flag() -> Iterator[None]:
    global _exporting
    previous, _exporting = _exporting, True
    try:
        yield
    finally:
        _exporting = previous


def export_module(
    module: torch.nn.Module, spec: BuildSpec, example: ExampleInputs, dynamic_shapes: object
) -> torch.export.ExportedProgram:
    """`torch.export.export` with the spec's dynamic shapes, errors made plain."""
    try:
        with _exporting_flag(), torch.no_grad():
            return torch.export.export(module, example.args, example.kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        raise ExportError(
            f"torch.export could not capture {spec.target} as one graph ({type(exc).__name__}): {first_lines(exc, 4)}"
        ) from exc
