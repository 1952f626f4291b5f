"""Compiling only what is new: each method's compiled model is kept in the
store by the key of everything it depends on, and a build whose graph was
compiled before links that model instead of compiling it (a checkpoint swap
of an external-weights package, one method changed among several)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..artifact import PACKAGE
from ..config.schema import WeightsMode
from ..runtime.hashing import canonical_sha256
from ..stages.compile import compile_package, method_options
from ..stages.export import Exported
from ..stages.package import combine_packages
from ..stages.progress import StageTimer
from .key import method_keys
from .plan import Plan
from .store import Store, link_or_copy

log = logging.getLogger("flashrt_build")


def compile_methods(
    plan: Plan, exported: list[Exported], options: dict[str, Any], package_path: Path, timer: StageTimer
) -> dict[str, bool]:
    """Compile each method into `package_path` (several: one model each,
    combined into one .pt2), reusing stored models; per method, whether it
    was reused."""
    spec = plan.spec
    store = Store(spec.output_root)
    keys = stored_keys(plan)
    cache = release_cache(plan)
    reused: dict[str, bool] = {}
    scratch = package_path.parent / ".methods"  # inside staging: a killed build leaves nothing behind
    try:
        parts = {}
        for e in exported:
            name, (key, kind) = e.method.name, keys.get(e.method.name, (None, None))
            part = scratch / name / PACKAGE if spec.multi_method else package_path
            part.parent.mkdir(parents=True, exist_ok=True)
            previous = store.package(key, kind) if key else None
            reused[name] = previous is not None
            if previous is not None:
                link_or_copy(previous, part)
                what = (
                    f"{name}: reusing the model of method key" if spec.multi_method else "reusing the package of graph"
                )
                log.info("%-11s %8s  %s %s", "compile", "skipped", what, key[:12])
            else:
                label = f"compile {name}" if spec.multi_method else "compile"
                target = f"{spec.target} method {name}" if spec.multi_method else spec.target
                with timer.stage(label):
                    compile_package(
                        e.program, {**options, **method_options(e, spec.method_inductor_options)}, part, target, cache
                    )
                if spec.multi_method:
                    store.put("methods", key, [part])
            parts[name] = part
        if spec.multi_method:
            combine_packages(parts, package_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return reused


def stored_keys(plan: Plan) -> dict[str, tuple[str, str]]:
    """Per method, (key, store kind) of its compiled model: each method of
    several by its own key; a lone external-weights forward by the graph key
    (its bytes do not depend on weight values); a lone baked one is not
    stored apart from its artifact."""
    spec = plan.spec
    if spec.multi_method:
        return {name: (key, "methods") for name, key in method_keys(plan.ingredients).items()}
    if spec.weights is WeightsMode.external:
        return {spec.default_method.name: (plan.keys["graph_key"], "packages")}
    return {}


def release_cache(plan: Plan) -> Path | None:
    """A release compiles in a fresh cache at a path fixed by its config alone,
    so the same config gives the same bytes from any directory (the path is
    written into the package) and different configs never share one."""
    if not plan.spec.release:
        return None
    return Path(tempfile.gettempdir()) / "flashrt_build-release" / canonical_sha256(plan.ingredients["config"])[:16]
