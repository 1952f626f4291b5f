"""The passes that rewrite an exported graph, after torch.export and before
the compile, in one table: what each does to a program and how its log
note reads; its name is its switch (`passes.<name>`). The export stage
runs the ones a build turns on over every method's program; each one's
counts by method become the manifest's `passes.<name>.methods` (empty
where it found nothing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config.spec import BuildSpec
from .decode_attention import share_masks
from .gemv_fusion import FUSED, fuse_gemv_neighbours
from .rotary_fusion import fuse_rotary

Counts = dict[str, int]  # what one rewrite did to one method's program, by kind


@dataclass(frozen=True)
class Rewrite:
    name: str  # the pass: its switch (`passes.<name>`, schema.PASS_SWITCHES) and its manifest entry
    run: Callable[[torch.export.ExportedProgram], Counts]  # rewrites in place; {} where nothing matched
    said: Callable[[Counts], str]  # the log's words for one method's counts


def _gemv_fusion(program: torch.export.ExportedProgram) -> Counts:
    counts = fuse_gemv_neighbours(program)
    return {what: counts[what] for what in FUSED} if counts else {}


REWRITES = (
    Rewrite(
        "gemv_fusion",
        _gemv_fusion,
        lambda took: "fused into GEMVs " + ", ".join(f"{count} {what}" for what, count in took.items()),
    ),
    Rewrite(
        "rotary_fusion",
        lambda program: {"queries": queries} if (queries := fuse_rotary(program)) else {},
        lambda took: f"{took['queries']} queries rotated in the attention kernel",
    ),
    Rewrite(
        "decode_attention",  # the part of that pass made in the graph: its masks shared
        lambda program: {"masks_shared": masks} if (masks := share_masks(program)) else {},
        lambda took: f"{took['masks_shared']} attention calls take an earlier call's mask",
    ),
)


def enabled_rewrites(spec: BuildSpec) -> tuple[Rewrite, ...]:
    """The rewrites `spec` turns on, in the order they run."""
    return tuple(rewrite for rewrite in REWRITES if getattr(spec, rewrite.name))


def rewrites_note(done: dict[str, dict[str, Counts]]) -> str:
    """The log's note on what each rewrite did, by method: `done` by pass, then method."""
    said = {rewrite.name: rewrite.said for rewrite in REWRITES}
    return "".join(f"; {method}: {said[name](took)}" for name, by in done.items() for method, took in by.items())
