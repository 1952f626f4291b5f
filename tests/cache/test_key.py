"""The build key's ingredients: pure logic, nothing is compiled."""

from __future__ import annotations

from pathlib import Path

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
