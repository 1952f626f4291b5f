"""Up to date means free: a build whose key matches a complete, intact
artifact at its output directory does no work. Imports no torch."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifact import MANIFEST, PACKAGE, written_files
from ..config.paths import refuse_foreign
from ..config.schema import WeightsMode
from ..errors import ArtifactError
from ..runtime.hashing import altered_digest, config_sha256
from ..runtime.manifest import read_manifest, write_manifest
from .key import changed_ingredients
from .plan import Plan
from .publish import build_lock, publish, staging_dir
from .store import Store, link_or_copy

log = logging.getLogger("flashrt_build")


def check_up_to_date(plan: Plan) -> tuple[bool, str]:
    """(True, why) when the artifact in place has this build key, every file it
    lists is intact, and it verified if verification is asked for; else (False, why)."""
    spec, keys = plan.spec, plan.keys
    try:
        manifest = read_manifest(spec.output_dir)
    except ArtifactError:
        return False, "no complete build at the output directory"
    idle = (manifest.get("passes") or {}).get("idle")
    if manifest.get("build_key") != keys["build_key"] and isinstance(idle, list):
        # the passes it found nothing for find nothing again: everything they read is in the key
        plan = plan.with_idle_passes(map(str, idle))
        keys = plan.keys
    if manifest.get("build_key") != keys["build_key"]:
        changed = changed_ingredients(manifest.get("key_ingredients"), plan.ingredients)
        return False, f"changed: {', '.join(changed)}"
    digests = plan.remembered  # a 2 GB package is hashed once, not on every check
    for section in (manifest["package"], manifest["weights"], manifest.get("state") or {}, *manifest.get("files", [])):
        if section.get("file"):
            path = spec.output_dir / section["file"]
            if not path.is_file():
                return False, f"{section['file']} is missing"
            known = digests.known(path)
            intact = known == section["sha256"] if known is not None else altered_digest(path, section) is None
            if not intact:
                return False, f"{section['file']} was altered since its build"
            if known is None:
                digests.remember(path, section["sha256"])
    digests.save()
    if spec.verify and manifest["verification"].get("passed") is not True:
        return False, "the build in place was not verified"
    return True, f"up to date (build key {keys['build_key'][:12]})"


def refuse_altered(plan: Plan) -> None:
    """The output directory's files by digest (remembered by stat, so an
    unchanged one is not read): a file of its build's name and size but other
    bytes is not the build's to replace. The swap checks the same before it
    deletes anything (publish.py); here it is said before any work."""
    digests, spec = plan.remembered, plan.spec
    shown = str(spec.output_dir)
    if not spec.config.get("output_dir"):  # a folder the user never named: say where it comes from
        shown += " (derived from output_root, module.name and the config's choices)"
    refuse_foreign(spec.output_dir, shown, lambda path, record: digests.sha256(path) != record["sha256"])


def fill_from_store(plan: Plan, sections: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """When an identical build is in the store, link its files into the output
    directory instead of building; returns the manifest, or None. The manifest
    is the stored one with this build's (cosmetic) config, and `sections` of
    this build's own (what its passes found to do: nothing)."""
    spec, keys = plan.spec, plan.keys
    entry = Store(spec.output_root).get("artifacts", keys["build_key"])
    if entry is None:
        return None
    manifest = json.loads((entry / MANIFEST).read_text())
    if spec.verify and manifest["verification"].get("passed") is not True:
        return None
    with build_lock(spec.output_dir), staging_dir(spec.output_dir) as staging:
        for path in entry.iterdir():
            if path.name not in ("sha256", MANIFEST):
                link_or_copy(path, staging / path.name)
        config = dict(spec.config)
        manifest.update(config=config, config_sha256=config_sha256(config), from_store=keys["build_key"])
        manifest.update(sections or {})
        write_manifest(staging, manifest)
        publish(staging, spec.output_dir)
    log.info("%s: identical to a stored build (build key %s), linked: %s", spec.name, keys["build_key"][:12],
             spec.output_dir)  # fmt: skip
    return manifest


@dataclass(frozen=True)
class Reuse:
    """Whether a plan needs building: "up_to_date" (the artifact in place is
    its build), "from_store" (linked from an identical stored build, now in
    place), or "build"; with the artifact's manifest when nothing is built."""

    status: str
    manifest: dict[str, Any] | None = None

    @property
    def built(self) -> bool:
        return self.status != "build"


def decide(plan: Plan, say_why: bool = True) -> Reuse:
    """Reuse or build: the one decision, for the command line, a sweep's job
    and the build alike, torch-free. A CUDA target's key names its GPU,
    which only torch can see: until the build has asked (`plan.keyed`), the
    answer is to build, and the build asks again."""
    spec = plan.spec
    if not plan.keyed:
        return Reuse("build")
    if spec.force:
        refuse_altered(plan)  # force rebuilds; it replaces only what a build wrote
        if say_why:
            log.info("%s: forced rebuild (force=true)", spec.name)
        return Reuse("build")
    fresh, why = check_up_to_date(plan)
    if not fresh:  # said now, not by the swap after the compile
        refuse_altered(plan)
    if fresh:
        with build_lock(spec.output_dir):  # also clears what an interrupted build left
            log.info("%s: %s, nothing to do: %s", spec.name, why, spec.output_dir)
        plan.remembered.save()
        return Reuse("up_to_date", read_manifest(spec.output_dir))
    filled = fill_from_store(plan)
    if filled is not None:
        plan.remembered.save()
        return Reuse("from_store", filled)
    if say_why:
        log.info("%s: %s", spec.name, why)
    return Reuse("build")


def decide_for_gpu(plan: Plan, decided: Reuse | None) -> tuple[Plan, Reuse]:
    """The plan keyed for the GPU the build sees (a CUDA target's key names
    its architecture), and the decision again where that key is new."""
    from ..runtime.gpu import gpu_of  # imports torch, as the build has already

    keyed = plan.for_gpu(gpu_of(plan.spec.device))
    if decided is None or not decided.built and keyed.gpu_keyed:
        decided = decide(keyed)
    return keyed, decided


@dataclass(frozen=True)
class StoredModels:
    """The store's compiled models, as the compile stage asks for them
    (`stages.compile.KeptModels`): per method, (key, where it is kept)."""

    keys: Mapping[str, tuple[str, str]]
    store: Store

    def find(self, key: str, where: str) -> Path | None:
        return self.store.package(key, where)

    def keep(self, key: str, part: Path) -> None:
        self.store.put("methods", key, [part])


def kept_models(plan: Plan) -> StoredModels:
    return StoredModels(plan.kept_model_keys(), Store(plan.spec.output_root))


def keep_built(plan: Plan) -> None:
    """The published artifact in the store by build key, and an external
    package by graph key: the next checkpoint of this graph links it."""
    spec, store = plan.spec, Store(plan.spec.output_root)
    if spec.weights is WeightsMode.external and not spec.multi_method:
        store.put("packages", plan.keys["graph_key"], [spec.output_dir / PACKAGE])
    written = written_files(read_manifest(spec.output_dir))
    store.put("artifacts", plan.keys["build_key"], [spec.output_dir / name for name in written])
