"""The pipeline: config -> plan -> preflight -> module -> reference -> passes -> quantize -> inputs -> exported
-> compiled -> package -> verified -> manifest -> published. Each stage is a
function in its own module returning its value, its manifest sections and
its log note; this file only strings them together."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig

from .artifact import PACKAGE
from .cache.plan import Plan, make_plan
from .cache.publish import build_lock, publish, staging_dir
from .cache.reuse import Reuse, check_up_to_date, decide_for_gpu, fill_from_store, keep_built, kept_models
from .config.schema import BuildConfig
from .config.spec import check_toolchain
from .errors import quiet_known_warnings
from .runtime.gpu import fp32_precision
from .runtime.manifest import read_manifest, write_manifest
from .stages.assemble import assemble_manifest, finish_manifest, passes_record
from .stages.compile import compile_stage
from .stages.domain import inputs_stage
from .stages.export import export_stage
from .stages.module import instantiate_stage
from .stages.package import package_stage
from .stages.passes import idle_passes, passes_stage
from .stages.preflight import preflight
from .stages.progress import StageTimer
from .stages.quantize import quantize_stage
from .stages.reference import reference_stage
from .stages.threads import apply_threads
from .stages.verify import verify_stage

log = logging.getLogger("flashrt_build")

# The stages a build times, in the order it runs them (the manifest's
# `timings`, the log's lines); `passes` and `quantize` only when chosen, `reference`
# and `verify` unless verification is off; a compile of several methods is timed per method ("compile NAME").
STAGES = (
    "instantiate", "reference", "passes", "quantize", "inputs", "export", "compile", "package", "verify", "manifest"
)  # fmt: skip


@dataclass
class BuildResult:
    """What `build` produced: where, the manifest, and whether work was done."""

    output_dir: Path
    manifest: Mapping[str, Any]
    status: str  # "built", "up_to_date" or "from_store"

    @property
    def package(self) -> Path:
        return self.output_dir / PACKAGE


def build(
    cfg: DictConfig | BuildConfig | Mapping[str, Any] | torch.nn.Module,
    cwd: Path | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    **options: Any,
) -> BuildResult:
    """Build one package from a config and publish it to its output directory.

    Or from a module object, as torch.export takes one: `build(model,
    example_inputs=(x,), dynamic_shapes=..., weights="external")`, the
    options `module_object.build_module`'s.

    Progress goes to the `flashrt_build` logger, as the command line's does:
    to stderr unless the application configured logging itself;
    `logging.getLogger("flashrt_build").setLevel(logging.WARNING)` silences it."""
    if isinstance(cfg, torch.nn.Module):
        from .module_object import build_module

        return cast(BuildResult, build_module(cfg, example_inputs, cwd=cwd, **options))
    if isinstance(cfg, type) and issubclass(cfg, torch.nn.Module):
        raise TypeError(
            f"model: expected an nn.Module object, got the class {cfg.__name__}: build({cfg.__name__}(...), ...)"
        )
    if example_inputs is not None or options:
        given = ", ".join(["example_inputs", *options] if example_inputs is not None else options)
        raise TypeError(f"build(cfg): {given} are options of a build from a module object, build(model, ...)")
    report_progress()
    quiet_known_warnings()
    return build_plan(make_plan(cfg, cwd))


def report_progress() -> None:
    """A handler on stderr for the build's progress, unless logging is set up already."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def build_plan(plan: Plan, decided: Reuse | None = None) -> BuildResult:
    """Build a resolved plan, unless the artifact in place (or in the store) is
    its build; `decided`: what the caller's `cache.reuse.decide` answered."""
    plan, decided = decide_for_gpu(plan, decided)  # a CUDA build's key names the GPU's architecture
    if decided.built:
        assert decided.manifest is not None
        return BuildResult(plan.spec.output_dir, decided.manifest, decided.status)
    check_toolchain(plan.spec)  # work to do: the compiler must compile
    with fp32_precision(plan.spec.tf32):  # export, compile and verify under the target's TF32 policy
        result = _run_stages(plan)
    plan.remembered.save(create=True)
    return result


def _run_stages(plan: Plan) -> BuildResult:
    spec, timer = plan.spec, StageTimer(plan.spec.name)
    apply_threads(spec.threads)
    options = preflight(spec)  # the checks that need torch, every problem at once
    log.info("building %s <%s> for %s/%s, weights %s -> %s", spec.name, spec.target, spec.device, spec.dtype,
             spec.weights.value, spec.output_dir)  # fmt: skip
    module = timer.run("instantiate", instantiate_stage, spec, plan.digests)
    # what the package must answer: the module as given, before a pass or a recipe rewrites it
    reference = timer.run("reference", reference_stage, module, spec) if spec.verify else None
    if spec.any_pass:  # before quantizing: fused float weights, quantized as one
        timer.run("passes", passes_stage, module, spec)
    quantized = timer.run("quantize", quantize_stage, module, spec) if spec.quant is not None else None
    timer.run("inputs", inputs_stage, module, spec, reference.ran_at_edges() if reference is not None else ())
    if reference is not None and reference.failure is not None:  # not a mistake of the inputs' config
        raise reference.failure
    exported = timer.run("export", export_stage, module, spec, quantized and quantized.methods)
    if spec.any_pass:  # a pass that rewrote nothing keys as off: this is the build without it
        plan = plan.with_idle_passes(idle_passes(spec, passes_record(timer.sections)))
        if plan.idle_passes:
            timer.sections["passes"]["idle"] = sorted(plan.idle_passes)
        if plan.idle_passes and not spec.force:
            filled = fill_from_store(plan, {"passes": passes_record(timer.sections)})
            if filled is not None:
                keep_built(plan)
                return BuildResult(spec.output_dir, filled, "from_store")
    # Builds of one output dir take turns from here to publishing; the stages
    # above run side by side, and a failure there leaves nothing on disk.
    with build_lock(spec.output_dir), staging_dir(spec.output_dir) as staging:
        if not spec.force and check_up_to_date(plan)[0]:
            log.info("%s: built meanwhile by another process: %s", spec.name, spec.output_dir)
            return BuildResult(spec.output_dir, read_manifest(spec.output_dir), "up_to_date")
        kept = kept_models(plan)
        compiled = compile_stage(spec, exported, options, staging / PACKAGE, kept, plan.compile_cache(), timer)
        state = timer.run("package", package_stage, spec, module, exported, compiled, plan.method_keys,
                          plan.toolchain, staging)  # fmt: skip
        sections = {"options": options, "keys": plan.keys, "ingredients": plan.ingredients, "digests": plan.digests}
        draft = assemble_manifest(spec, timer.sections, **sections, timings=dict(timer.timings))
        if reference is not None:  # the package is loaded against the draft, as users will load it
            timer.run("verify", verify_stage, spec, module, staging, draft, state, reference, quantized)
        else:
            log.warning("verification is off (verify.enabled=false): the package is recorded as unverified")
        record = finish_manifest(draft, timer.sections.get("verification"), timer.timings)
        with timer.stage("manifest"):
            write_manifest(staging, record)
        publish(staging, spec.output_dir)
    keep_built(plan)
    log.info("artifact: %s", spec.output_dir)
    return BuildResult(spec.output_dir, record, "built")


__all__ = ["STAGES", "BuildResult", "build", "build_plan"]
