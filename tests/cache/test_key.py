"""The build key's ingredients: pure logic, nothing is compiled."""

from __future__ import annotations

import functools
from dataclasses import is_dataclass
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.cache.key import method_keys
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.config.targets import source_tree_sha256


def test_the_tool_ingredient_covers_every_folder_of_flashrt_build() -> None:
    """The key's `flashrt_build` ingredient hashes the whole package: a change
    in any stage (stages/, runtime/, ...) must invalidate built artifacts."""
    package = Path(flashrt_build.__file__).resolve().parent
    sha, files = source_tree_sha256(str(package))
    assert make_plan(compose(["+module=mlp"])).ingredients["flashrt_build"] == sha
    assert files == len(list(package.rglob("*.py"))) and {"stages", "runtime", "config"} <= {
        p.parent.name for p in package.rglob("*.py")
    }


def test_one_methods_options_change_that_methods_key_only() -> None:
    """Per-method Inductor options, the profile's or a quant recipe's, enter
    that method's key alone: the other methods' compiled models are reused."""
    base = ["+module=tiny_lm", "quant=int8_wo"]
    keys = method_keys(make_plan(compose(base)).ingredients)
    for section in ("inductor", "quant.inductor"):
        override = f"+{section}.methods.prefill.max_autotune=true"
        changed = method_keys(make_plan(compose([*base, override])).ingredients)
        assert changed["decode"] == keys["decode"] and changed["prefill"] != keys["prefill"], override


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of the config schema: a dataclass field, or a nested group's fields."""
    keys = []
    for name, hint in get_type_hints(cls).items():
        nested = [t for t in (hint, *get_args(hint)) if is_dataclass(t)]
        keys += _schema_keys(nested[0], f"{prefix}{name}.") if nested else [f"{prefix}{name}"]
    return keys


# Each key the build key reads, with a change of it: (module, overrides it changes from, its change).
KEYED = {
    "module.model": ("mlp", [], ["module.model.hidden=32"]),
    "module.inputs": ("mlp", [], ["module.inputs.x.shape=[8,16]"]),
    "module.kwargs": ("mlp", [], ["+module.kwargs.scale=2"]),
    "module.methods": ("tiny_lm", [], ["module.methods.decode.inputs.position.high=32"]),
    "target.device": ("mlp", [], ["target.device=cuda"]),
    "target.dtype": ("mlp", [], ["target.dtype=bfloat16"]),
    "target.tf32": ("mlp", ["target=cuda", "target.dtype=float32"], ["target.tf32=true"]),
    "inductor.options": ("mlp", [], ["+inductor.options.max_autotune=true"]),
    "inductor.methods": ("tiny_lm", [], ["+inductor.methods.decode.max_autotune=true"]),
    "quant.name": ("mlp", ["quant=int8_wo"], ["quant.name=int8_b"]),
    "quant.rules": ("mlp", [], ["quant=int8_wo"]),
    "passes.fuse_projections": ("mlp", [], ["passes.fuse_projections=true"]),
    "passes.grouped_attention": ("mlp", [], ["passes.grouped_attention=true"]),
    "passes.gemv": ("mlp", [], ["passes.gemv=true"]),
    "passes.gemv_fusion": ("mlp", [], ["passes.gemv_fusion=true"]),
    "passes.decode_attention": ("mlp", [], ["passes.decode_attention=true"]),
    "passes.rotary_fusion": ("mlp", [], ["passes.rotary_fusion=true"]),
    "passes.one_kernel_attention": ("mlp", [], ["passes.one_kernel_attention=true"]),
    "passes.combo_kernels": ("mlp", [], ["passes.combo_kernels=true"]),
    "passes.pdl": ("mlp", [], ["passes.pdl=true"]),
    "weights": ("mlp", [], ["weights=external"]),
    "serve.state": ("tiny_lm", [], ["serve.state=threaded"]),
    "release": ("mlp", [], ["release=true"]),
}
# Keys NOT_KEYED leaves out, with a change of each (over the mlp and `base`) that
# must leave the graph key as it was, and the build key too unless it is keyed
# elsewhere (True).
UNKEYED = {
    "output_root": ([], ["output_root=elsewhere"], False),
    "variant": ([], ["variant=mine"], False),
    "force": ([], ["force=true"], False),
    "threads": ([], ["threads=1"], False),
    "verify.atol": ([], ["verify.atol=0.5"], False),
    "verify.enabled": ([], ["verify.enabled=false"], False),
    "allowed_targets": ([], ["allowed_targets=[flashrt_build.*]"], False),
    "target.name": ([], ["target.name=mine"], False),
    "inductor.name": ([], ["inductor.name=mine"], False),
    "passes.name": ([], ["passes.name=mine"], False),
    "module.name": ([], ["module.name=mlp_b"], True),
    "quant.devices": (["quant=int8_wo"], ["quant.devices=[cpu]"], False),
    "quant.rtol": (["quant=int8_wo"], ["quant.rtol=0.1"], False),
    "seed": ([], ["seed=3"], True),
    "module.checkpoint_rename": (
        ["module.checkpoint={checkpoint}"],
        ["module.checkpoint_rename=[{pattern:a,replace:b}]"],
        True,
    ),
    "quant.max_rel_error": (["quant=int8_wo"], ["quant.max_rel_error=0.5"], True),
    "serve.cuda_graphs": (["target=cuda"], ["serve.cuda_graphs=true"], True),
    "serve.max_graphs": ([], ["serve.max_graphs=2"], True),
}


def test_every_config_key_is_keyed_or_left_out_with_a_reason() -> None:
    """A key added to the schema must be read by the build key (through the
    spec's typed fields) or named in NOT_KEYED with why: a key nobody decided
    on would let a changed build pass for up to date."""
    from flashrt_build.cache.key import NOT_KEYED
    from flashrt_build.config.schema import BuildConfig

    def under(key: str, decided: object) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:n]) in decided for n in range(1, len(parts) + 1))  # type: ignore[operator]

    assert [key for key in _schema_keys(BuildConfig) if not under(key, {*KEYED, *NOT_KEYED})] == []
    assert not set(KEYED) & set(NOT_KEYED) and all(under(key, NOT_KEYED) for key in UNKEYED)


@functools.cache
def _keys(*overrides: str) -> dict[str, str]:
    """The keys of a plan of these overrides (each base is planned once for all its changes)."""
    return make_plan(compose(list(overrides)), cwd=Path.cwd()).keys


@pytest.mark.parametrize("key", sorted(KEYED))
def test_a_keyed_config_key_changes_the_graph_key(key: str, tmp_path: Path) -> None:
    module, base, change = KEYED[key]
    checkpoint = tmp_path / "mlp.safetensors"
    save_file({"unused": torch.zeros(1)}, str(checkpoint))
    base = [f"+module={module}", *(override.format(checkpoint=checkpoint) for override in base)]
    before, after = _keys(*base), _keys(*base, *change)
    assert after["graph_key"] != before["graph_key"] and after["build_key"] != before["build_key"], change


@pytest.mark.parametrize("key", sorted(UNKEYED))
def test_a_key_left_out_leaves_the_graph_key(key: str, tmp_path: Path) -> None:
    base, change, build_keyed = UNKEYED[key]
    checkpoint = tmp_path / "mlp.safetensors"
    save_file({"unused": torch.zeros(1)}, str(checkpoint))
    base = [override.format(checkpoint=checkpoint) for override in base]
    before, after = _keys("+module=mlp", *base), _keys("+module=mlp", *base, *change)
    assert after["graph_key"] == before["graph_key"], change
    assert (after["build_key"] != before["build_key"]) is build_keyed, change
