"""Tiny random causal LMs of every family `causal_lm` is tested on, saved as
`save_pretrained` saves them (sharded), with weights sharp enough that greedy
tokens differ from step to step (the default init's near-uniform logits repeat
one token, which would prove little)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = {"vocab_size": 256, "max_position_embeddings": 256, "num_hidden_layers": 2}
LLAMA_LIKE = {**COMMON, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "llama": ("llama", LLAMA_LIKE),
    "mistral": ("mistral", {**LLAMA_LIKE, "sliding_window": 4}),
    "qwen2": ("qwen2", LLAMA_LIKE),
    "gemma": ("gemma", {**LLAMA_LIKE, "head_dim": 16}),
    "gemma3": ("gemma3_text", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4,
                               "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False}),
    "phi3": ("phi3", {**LLAMA_LIKE, "pad_token_id": 0}),
    "gpt2": ("gpt2", {"vocab_size": 256, "n_positions": 256, "n_layer": 2, "n_embd": 64, "n_head": 4}),
    "opt": ("opt", {**COMMON, "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "word_embed_proj_dim": 64}),
    "mixtral": ("mixtral", {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {**LLAMA_LIKE, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": []}),
}  # fmt: skip


def save_family(family: str, directory: Path, seed: int = 0) -> Path:
    """A 2-layer, width-64 `family` model with random sharpened weights, saved sharded."""
    import transformers

    model_type, settings = FAMILIES[family]
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(15) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(directory, max_shard_size="200KB")
    return directory


def transformers_tokens(directory: Path, prompt: torch.Tensor, new: int, eos: int | None = None) -> torch.Tensor:
    """transformers' own greedy tokens from the same directory: the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(
            prompt, do_sample=False, max_new_tokens=new, min_new_tokens=1 if eos is not None else new,
            eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
    return out[:, prompt.shape[1] :]


def save_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer over the 256-token vocabulary (one token a byte),
    with a chat template, saved beside the model as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = (
        "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    )
    fast.save_pretrained(directory)


def copied(directory: Path, where: Path) -> Path:
    """A copy of a saved model's directory, to change without touching the original."""
    import shutil

    shutil.copytree(directory, where)
    return where


def causal_lm_overrides(directory: Path | str, root: Path, *more: str) -> list[str]:
    """`+module=causal_lm` of `directory` with a short cache, into `root`."""
    return ["+module=causal_lm", f"module.pretrained={directory}", "module.max_cache_len=32", f"output_root={root}",
            *more]  # fmt: skip


# The families by the test file that builds them (two, so that two test workers share the compiles).
DENSE_ROTARY = ["llama", "mistral", "qwen2", "gemma", "gemma3", "phi3"]
OTHER_LAYOUTS = ["gpt2", "opt", "mixtral", "qwen3_moe"]

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


def builds_verifies_and_generates(family: str, request: Any, tmp_path_factory: Any) -> None:
    """`family` built with the shipped causal_lm config: verified, its cache
    the package's state in place, and transformers' own greedy tokens."""
    import flashrt_build
    from flashrt_build.config.compose import compose

    if family == "llama":  # the session's llama_lm_build, which other tests share
        result, model_dir = request.getfixturevalue("llama_lm_build")
    else:
        root = tmp_path_factory.mktemp(family)
        model_dir = save_family(family, root / family)
        result = flashrt_build.build(compose(causal_lm_overrides(model_dir, root / "out", "module.max_prompt=16",
                                                                 "weights=external")))  # fmt: skip
    manifest = result.manifest
    assert manifest["verification"]["passed"] is True
    assert set(manifest["methods"]) == {"prefill", "decode"}
    state = {t["fqn"] for t in manifest["state"]["tensors"]}
    assert manifest["state"]["mode"] == "in_place" and {"kv_0_keys", "kv_0_values", "kv_1_keys"} <= state
    # the cache's count of tokens is each call's own, not state: as a buffer every layer's `add_` was a write
    assert all(fqn.endswith(("_keys", "_values")) for fqn in state), state
    assert manifest["methods"]["decode"]["state"] == manifest["methods"]["prefill"]["state"]  # one cache, shared
    model = flashrt_build.load(result.output_dir)
    ours = flashrt_build.generate(model, PROMPT, 9).tokens
    assert ours.tolist() == transformers_tokens(model_dir, PROMPT, 9).tolist()
    assert len(set(ours[0].tolist())) > 2  # tokens that say something: not one repeated
