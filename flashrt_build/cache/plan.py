"""A build resolved once: its spec, the digest of every file it reads, its
toolchain, the key's ingredients and the keys. The command line makes the
plan without importing torch to decide whether there is work; the build takes
the same plan on, so nothing is resolved or hashed twice."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.compose import Naming, as_build_config, name_and_place
from ..config.schema import PASS_SWITCHES, WeightsMode
from ..config.spec import BuildSpec, resolve_spec
from ..config.targets import module_source, use_import_paths
from ..config.toolchain import describe_toolchain
from ..runtime.hashing import canonical_sha256
from .digests import DigestCache
from .key import build_keys, input_digests, key_ingredients, method_keys
from .store import Store


@dataclass(frozen=True)
class Plan:
    spec: BuildSpec
    digests: dict[str, str]  # sha256 of every file the build reads, by label
    toolchain: dict[str, Any]  # what builds it: the manifest's section, the key's fields
    ingredients: dict[str, Any]
    keys: dict[str, str]  # graph_key, build_key
    remembered: DigestCache  # the digests remembered by stat: saved when the build succeeds
    # per method of several, the key of everything its own compiled model depends on
    method_keys: dict[str, str] = field(default_factory=dict)
    gpu_keyed: bool = False  # a CUDA target's key names its GPU once the build has asked torch
    source: dict[str, Any] = field(default_factory=dict)  # what the module's code is, as the key hashes it
    # the passes turned on that rewrote nothing, keyed as off: found by the build (or its manifest)
    idle_passes: frozenset[str] = frozenset()

    @property
    def keyed(self) -> bool:
        """Is the key final? A CUDA target's names its GPU's architecture, which only torch can see."""
        return self.gpu_keyed or not self.spec.device.startswith("cuda")

    def for_gpu(self, gpu: dict[str, Any] | None) -> Plan:
        """The plan of a CUDA target, its key naming the GPU's architecture
        (`runtime.gpu.gpu_of`, known once torch can ask the device)."""
        cxx = self.spec.inductor_options.get("cpp.cxx")
        return self if gpu is None else _keyed(
            self.spec, self.source, describe_toolchain(cxx, gpu), self.digests, self.remembered, True,
            self.idle_passes,
        )  # fmt: skip

    def with_idle_passes(self, idle: Iterable[str]) -> Plan:
        """The plan keyed with these passes as off: each one on that rewrote
        nothing (the build found it, or the manifest of the build in place
        says so), so the key is that of the same build without it."""
        idle = frozenset(idle) & {switch for switch in PASS_SWITCHES if getattr(self.spec, switch)}
        if idle == self.idle_passes:
            return self
        return _keyed(self.spec, self.source, self.toolchain, self.digests, self.remembered, self.gpu_keyed, idle)

    def kept_model_keys(self) -> dict[str, tuple[str, str]]:
        """Per method, (key, store kind) its compiled model is kept by: each of
        several by its own method key; a lone external-weights forward by the
        graph key (its bytes do not depend on weight values); a lone baked one
        is not kept apart from its artifact."""
        if self.spec.multi_method:
            return {name: (key, "methods") for name, key in self.method_keys.items()}
        if self.spec.weights is WeightsMode.external:
            return {self.spec.default_method.name: (self.keys["graph_key"], "packages")}
        return {}

    def compile_cache(self) -> Path | None:
        """A release compiles in a fresh cache at a path fixed by its config
        alone, so the same config gives the same bytes from any directory (the
        path is written into the package) and different configs never share one."""
        if not self.spec.release:
            return None
        digest = canonical_sha256(self.ingredients["config"])[:16]
        return Path(tempfile.gettempdir()) / "flashrt_build-release" / digest


def make_plan(cfg: Any, cwd: Path | None = None, naming: Naming | None = None) -> Plan:
    """Resolve a config (composed, a BuildConfig or a mapping) into a plan,
    without torch; `naming`: the command line's, which names its output folder."""
    if naming is not None:
        name_and_place(cfg, naming.baseline, naming.config_dir)
    spec = resolve_spec(as_build_config(cfg), cwd, probe_compiler=False)  # run by a build: up to date compiles nothing
    use_import_paths(spec.import_paths)  # before anything looks the module's code up
    source = module_source(spec.target)
    toolchain = describe_toolchain(spec.inductor_options.get("cpp.cxx"), None)
    remembered = DigestCache(Store(spec.output_root).root)
    return _keyed(spec, source, toolchain, input_digests(spec, remembered), remembered, gpu_keyed=False)


def _keyed(
    spec: BuildSpec, source: dict[str, Any], toolchain: dict[str, Any], digests: dict[str, str],
    remembered: DigestCache, gpu_keyed: bool, idle_passes: frozenset[str] = frozenset(),
) -> Plan:  # fmt: skip
    ingredients = key_ingredients(spec, source, toolchain, digests, idle_passes)
    methods = method_keys(ingredients) if spec.multi_method else {}
    return Plan(spec, digests, toolchain, ingredients, build_keys(ingredients), remembered, methods, gpu_keyed,
                source, idle_passes)  # fmt: skip


__all__ = ["Plan", "make_plan"]
