"""The pipeline: config -> plan -> preflight -> module -> inputs -> exported
-> compiled -> package -> verified -> manifest -> published. Each stage is a
function in its own module returning its value, its manifest sections and
its log note; this file only strings them together."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .artifact import PACKAGE, written_files
from .cache.plan import Plan, make_plan
from .cache.reuse import Reuse, check_up_to_date, decide
from .cache.store import Store
from .config.schema import BuildConfig, WeightsMode
from .errors import quiet_known_warnings
from .runtime.gpu import fp32_precision, gpu_of
from .runtime.manifest import read_manifest, write_manifest
from .stages.assemble import assemble_manifest, finish_manifest
from .stages.compile import KeptModels, compile_stage
from .stages.domain import inputs_stage
from .stages.export import export_stage
from .stages.module import instantiate_stage
from .stages.package import package_stage
from .stages.preflight import preflight
from .stages.progress import StageTimer
from .stages.publish import build_lock, publish, staging_dir
from .stages.quantize import quantize_stage
from .stages.threads import apply_threads
from .stages.verify import verify_stage

log = logging.getLogger("flashrt_build")


@dataclass
class BuildResult:
    """What `build` produced: where, the manifest, and whether work was done."""

    output_dir: Path
    manifest: Mapping[str, Any]
    status: str  # "built", "up_to_date" or "from_store"

    @property
    def package(self) -> Path:
        return self.output_dir / PACKAGE


def build(cfg: DictConfig | BuildConfig | Mapping[str, Any], cwd: Path | None = None) -> BuildResult:
    """Build one package from a config and publish it to its output directory.

    Progress goes to the `flashrt_build` logger, as the command line's does:
    to stderr unless the application configured logging itself;
    `logging.getLogger("flashrt_build").setLevel(logging.WARNING)` silences it."""
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
    spec = plan.spec
    apply_threads(spec.threads)
    options = preflight(spec)  # the checks that need torch, every problem at once
    plan = plan.for_gpu(gpu_of(spec.device))  # a CUDA build's key names the GPU's architecture
    if decided is None or not decided.built and plan.gpu_keyed:
        decided = decide(plan)
    if decided.built:
        assert decided.manifest is not None
        return BuildResult(spec.output_dir, decided.manifest, decided.status)
    with fp32_precision(spec.tf32):  # export, compile and verify under the target's TF32 policy
        result = _run_stages(plan, options)
    plan.remembered.save(create=True)
    return result


def _run_stages(plan: Plan, options: dict[str, Any]) -> BuildResult:
    spec, timer = plan.spec, StageTimer(plan.spec.name)
    log.info("building %s <%s> for %s/%s, weights %s -> %s", spec.name, spec.target, spec.device, spec.dtype,
             spec.weights.value, spec.output_dir)  # fmt: skip
    module = timer.run("instantiate", instantiate_stage, spec, plan.digests)
    originals = timer.run("quantize", quantize_stage, module, spec) if spec.quant is not None else None
    timer.run("inputs", inputs_stage, module, spec)
    exported = timer.run("export", export_stage, module, spec)
    # Builds of one output dir take turns from here to publishing; the stages
    # above run side by side, and a failure there leaves nothing on disk.
    with build_lock(spec.output_dir), staging_dir(spec.output_dir) as staging:
        if not spec.force and check_up_to_date(plan)[0]:
            log.info("%s: built meanwhile by another process: %s", spec.name, spec.output_dir)
            return BuildResult(spec.output_dir, read_manifest(spec.output_dir), "up_to_date")
        kept = _kept_models(plan)
        compiled = compile_stage(spec, exported, options, staging / PACKAGE, kept, plan.compile_cache(), timer)
        state = timer.run("package", package_stage, spec, module, exported, compiled, plan.method_keys,
                          plan.toolchain, staging)  # fmt: skip
        sections = {"options": options, "keys": plan.keys, "ingredients": plan.ingredients, "digests": plan.digests}
        draft = assemble_manifest(spec, timer.sections, **sections, timings=dict(timer.timings))
        if spec.verify:  # the package is loaded against the draft, as users will load it
            timer.run("verify", verify_stage, spec, module, staging, draft, state, originals)
        else:
            log.warning("verification is off (verify.enabled=false): the package is recorded as unverified")
        record = finish_manifest(draft, timer.sections.get("verification"), timer.timings)
        with timer.stage("manifest"):
            write_manifest(staging, record)
        publish(staging, spec.output_dir)
    _keep_in_store(plan)
    log.info("artifact: %s", spec.output_dir)
    return BuildResult(spec.output_dir, record, "built")


def _kept_models(plan: Plan) -> KeptModels:
    """The store's compiled models, as the compile stage asks for them."""
    store = Store(plan.spec.output_root)
    return KeptModels(
        plan.kept_model_keys(),
        lambda key, kind: store.package(key, kind),
        lambda key, part: store.put("methods", key, [part]),
    )


def _keep_in_store(plan: Plan) -> None:
    """The published artifact in the store by build key, and an external
    package by graph key: the next checkpoint of this graph links it."""
    spec, store = plan.spec, Store(plan.spec.output_root)
    if spec.weights is WeightsMode.external and not spec.multi_method:
        store.put("packages", plan.keys["graph_key"], [spec.output_dir / PACKAGE])
    written = written_files(read_manifest(spec.output_dir))
    store.put("artifacts", plan.keys["build_key"], [spec.output_dir / name for name in written])


__all__ = ["BuildResult", "build", "build_plan"]
