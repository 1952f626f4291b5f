"""Whether flashrt_build is tracing a module right now (the export stage
says so while it runs torch.export): model code steps Python-side
bookkeeping aside, and the decode passes' layers take their Triton
kernels only then, so the eager reference that verifies a package keeps
torch's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_exporting = False


def is_exporting() -> bool:
    """True while flashrt_build traces a module, so model code can step
    Python-side bookkeeping (counters, caches, logging) aside."""
    return _exporting or torch.compiler.is_exporting()


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """`is_exporting()` is True inside."""
    global _exporting
    previous, _exporting = _exporting, True
    try:
        yield
    finally:
        _exporting = previous
