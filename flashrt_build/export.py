"""Stage 4: capture the module as one graph with torch.export.

A graph break or any export failure is an error naming the module target and
torch's reason. There is no fallback to a partial graph or to eager.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator

import torch

from .errors import ExportError, first_lines
from .inputs import ExampleInputs
from .spec import BuildSpec

log = logging.getLogger(__name__)
_exporting = False


def is_exporting() -> bool:
    """True while flashrt_build traces a module, so model code can step
    Python-side bookkeeping (counters, caches, logging) aside."""
    return _exporting or torch.compiler.is_exporting()


@contextlib.contextmanager
def _exporting_flag() -> Iterator[None]:
    global _exporting
    previous, _exporting = _exporting, True
    # On a failed guard, symbolic_shapes logs whole graph dumps as warnings;
    # the ExportError already carries the reason.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        _exporting = previous
        shapes_log.setLevel(level)


def export_module(
    module: torch.nn.Module, spec: BuildSpec, example: ExampleInputs, dynamic_shapes: object
) -> torch.export.ExportedProgram:
    """`torch.export.export` with the spec's dynamic shapes, errors made plain."""
    # A failed export prints its partial graph to stderr; keep it at debug
    # level instead of burying the one-line error under it.
    printed = io.StringIO()
    try:
        with _exporting_flag(), torch.no_grad(), contextlib.redirect_stderr(printed):
            return torch.export.export(module, example.args, example.kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        log.debug("torch.export printed:\n%s", printed.getvalue())
        where = _user_frame(printed.getvalue())
        raise ExportError(
            f"torch.export could not capture {spec.target} as one graph"
            f"{f' at {where}' if where else ''} ({type(exc).__name__}): {first_lines(exc, 4)}"
        ) from exc


def _user_frame(partial_graph: str) -> str | None:
    """The last source line the partial graph reached: where tracing stopped."""
    frames = re.findall(r"# File: (.+?), code: (.+)", partial_graph)
    return f"{frames[-1][0]}: `{frames[-1][1].strip()}`" if frames else None
