"""Every Llama-like family `causal_lm` serves (dense decoders with rotary
positions: Llama, Mistral, Qwen2, Gemma, Gemma 3, Phi-3) builds from its
save_pretrained directory, verifies, and generates transformers' own greedy
tokens (tests/llm_families.py). Apart from test_causal_lm_other_layouts.py so
that two test workers share the compiles."""

from __future__ import annotations

import pytest
from llm_families import DENSE_ROTARY, builds_verifies_and_generates

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", DENSE_ROTARY)
def test_a_family_builds_verifies_and_generates_transformers_tokens(
    family: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    builds_verifies_and_generates(family, request, tmp_path_factory)
