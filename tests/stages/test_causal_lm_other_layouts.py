"""The families `causal_lm` serves whose layouts are not Llama's: GPT-2 and
OPT (learned positions, their own attention), Mixtral and Qwen3-MoE
(mixtures of experts): each builds from its save_pretrained directory,
verifies, and generates transformers' own greedy tokens."""

from __future__ import annotations

import pytest
from llm_families import DENSE_ROTARY, FAMILIES, OTHER_LAYOUTS, builds_verifies_and_generates

pytestmark = pytest.mark.slow


def test_every_family_is_built_by_one_file_or_the_other() -> None:
    assert sorted([*DENSE_ROTARY, *OTHER_LAYOUTS]) == sorted(FAMILIES)


@pytest.mark.parametrize("family", OTHER_LAYOUTS)
def test_a_family_builds_verifies_and_generates_transformers_tokens(
    family: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    builds_verifies_and_generates(family, request, tmp_path_factory)
