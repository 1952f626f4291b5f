"""A build resolved once: its spec, the digest of every file it reads, its
toolchain, the key's ingredients and the keys. The command line makes the
plan without importing torch to decide whether there is work; the build takes
the same plan on, so nothing is resolved or hashed twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.compose import as_build_config
from ..config.spec import BuildSpec, resolve_spec
from ..config.targets import use_import_paths
from ..config.toolchain import describe_toolchain
from .digests import DigestCache
from .key import build_keys, input_digests, key_ingredients
from .store import Store


@dataclass(frozen=True)
class Plan:
    spec: BuildSpec
    digests: dict[str, str]  # sha256 of every file the build reads, by label
    toolchain: dict[str, Any]  # what builds it: the manifest's section, the key's fields
    ingredients: dict[str, Any]
    keys: dict[str, str]  # graph_key, build_key
    remembered: DigestCache  # the digests remembered by stat: saved when the build succeeds

    def for_gpu(self, gpu: dict[str, Any] | None) -> Plan:
        """The plan of a CUDA target, its key naming the GPU's architecture
        (known once torch can ask the device)."""
        if gpu is None:
            return self
        return _keyed(self.spec, self.digests, self.remembered, gpu)


def make_plan(cfg: Any, cwd: Path | None = None) -> Plan:
    """Resolve a config (composed, a BuildConfig or a mapping) into a plan, without torch."""
    spec = resolve_spec(as_build_config(cfg), cwd)
    use_import_paths(spec.import_paths)  # before anything looks the module's code up
    remembered = DigestCache(Store(spec.output_root).root)
    return _keyed(spec, input_digests(spec, remembered), remembered, None)


def _keyed(spec: BuildSpec, digests: dict[str, str], remembered: DigestCache, gpu: dict[str, Any] | None) -> Plan:
    toolchain = describe_toolchain(spec.inductor_options.get("cpp.cxx"), gpu)
    ingredients = key_ingredients(spec, toolchain, digests)
    return Plan(spec, digests, toolchain, ingredients, build_keys(ingredients), remembered)


__all__ = ["Plan", "make_plan"]
