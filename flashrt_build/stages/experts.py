"""transformers' mixture-of-experts layers, made exportable: their default
`grouped_mm` path traces into `transformers::grouped_mm_fallback`, a
Python-only custom operator no package can run, while `batched_mm` computes
the same in plain aten. The export stage switches them, after the reference
ran the model as the user gave it, and says so."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

RUNNABLE = "batched_mm"


def runnable_experts(module: nn.Module) -> int:
    """Switch every transformers model in `module` whose experts run
    `grouped_mm` to `batched_mm`; how many were switched."""
    switched = 0
    for model in module.modules():
        config = getattr(model, "config", None)
        can_set = getattr(model, "_can_set_experts_implementation", lambda: False)
        if getattr(config, "_experts_implementation", None) == "grouped_mm" and can_set():
            cast(Any, model).set_experts_implementation(RUNNABLE)  # its submodules share the config: switched too
            switched += 1
    return switched
