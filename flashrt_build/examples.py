"""Small modules that live in the repo, used by the shipped configs and tests.

    python -m flashrt_build.examples DIR
    python -m flashrt_build.examples --llm DIR

writes a small trained-looking GPT-2 the way `save_pretrained` stores a real
one (config.json, three bf16 safetensors shards and their index, the tied
lm_head left out), for `+module=pretrained_gpt2` and the README's examples;
with `--llm`, a small Llama that has learned a story by heart, with its
tokenizer, for `+module=causal_lm` and the README's LLM guide.
DIR must be new or empty: a directory that holds anything (a model of your
own) or a file is refused, exit 2, and nothing is written; no DIR, exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .artifact import enclosing_build


class MLP(nn.Module):
    """A two-layer perceptron with a layer norm, a registered buffer and a
    tiny in-forward constant: the kinds of tensor a package must bind."""

    def __init__(self, in_features: int = 16, hidden: int = 64, out_features: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_features)
        self.register_buffer("output_scale", torch.full((out_features,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.norm(self.fc1(x)))
        # A literal in forward: export lifts it as a constant the package binds.
        bias = torch.tensor([0.25, -0.25, 0.5, -0.5, 0.75, -0.75, 1.0, -1.0], dtype=x.dtype, device=x.device)
        return self.fc2(h) * self.output_scale + bias


class _Block(nn.Module):
    """Pre-norm attention and MLP; the caller owns the KV cache."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        return tuple(t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.out(attended.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A decoder-only LM with a static KV cache, the shape of an LLM served in
    two steps: `forward` is the prefill (a prompt of any length fills the
    cache from position 0) and `decode` one token at a position (writes that
    position of the cache and attends to everything up to it)."""

    kv_cache: torch.Tensor

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        # [layer, key/value, batch, head, position, head_dim]: the decoder's state.
        self.register_buffer("kv_cache", torch.zeros(layers, 2, 1, heads, max_len, dim // heads))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        positions = torch.arange(length, device=input_ids.device)
        for i, block in enumerate(self._blocks()):
            q, k, v = block.qkv_heads(x)
            self._store(i, k, v, positions)
            x = block.finish(x, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.head(self.norm(x))

    def _blocks(self) -> list[_Block]:
        return [cast(_Block, block) for block in self.blocks]

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k and v [batch, head, n, head_dim] of `layer` at `positions` [n].
        Indexed on the whole buffer by tensors, one `index_put_`, which the
        compiled code does in place: written through a view of the buffer
        (`kv_cache[i, 0].index_copy_(...)`), the cache was copied whole for
        every layer, most of a decode step."""
        device = positions.device
        layer_index = torch.full((1, 1), layer, dtype=torch.int64, device=device)
        key_or_value = torch.arange(2, device=device).view(2, 1)
        stacked = torch.stack([k, v]).permute(0, 3, 1, 2, 4)  # [2, n, batch, head, head_dim]
        self.kv_cache[layer_index, key_or_value, :, :, positions.view(1, -1)] = stacked

    def decode(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One token (`input_ids` [1, 1]) at `position` ([1]): logits [1, 1, vocab]."""
        x = self.embed(input_ids) + self.position(position)[None]
        visible = (torch.arange(self.kv_cache.shape[4], device=position.device) <= position).view(1, 1, 1, -1)
        for i, block in enumerate(self._blocks()):
            q, k, v = block.qkv_heads(x)
            self._store(i, k, v, position)
            keys, values = self.kv_cache[i, 0], self.kv_cache[i, 1]
            attended = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
            x = block.finish(x, attended)
        return self.head(self.norm(x))


class T5Seq2Seq(nn.Module):
    """A transformers T5 as two entry points: `encode` a source once, then
    `decode` target tokens against its hidden states (what a translation or
    summarisation server calls, step after step)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import T5ForConditionalGeneration

        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.decode(decoder_input_ids, self.encode(input_ids))

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.t5.encoder(input_ids=input_ids).last_hidden_state

    def decode(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.t5(
            encoder_outputs=(encoder_hidden_states,), decoder_input_ids=decoder_input_ids, use_cache=False
        ).logits


def save_gpt2_tiny(directory: str, seed: int = 1234, max_shard_size: str = "400KB") -> None:
    """A 2-layer GPT-2 (gpt2_tiny's shape) with seeded weights, saved as
    `save_pretrained` saves one: bf16, sharded, tied weights written once."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)


STORY = (
    "Once upon a time, a small model learned one story by heart. It was built into a package, "
    "verified against itself, and told the story again, word for word, on every machine."
)
END = "<|endoftext|>"


def save_story_llama(directory: str, steps: int = 200, seed: int = 0) -> None:
    """A 2-layer Llama that has learned STORY by heart, saved as
    `save_pretrained` saves one, beside a byte-level tokenizer (a token a
    byte, and END) and a generation config that stops at END: a model whose
    greedy continuation of "Once upon a time" is the story, so what a
    package generates can be read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils.logging import disable_progress_bar

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END)
    end = fast.convert_tokens_to_ids(END)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=end)  # fmt: skip
    model = LlamaForCausalLM(config)
    text = torch.tensor([fast.encode(STORY) + [end]])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=text, labels=text).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    disable_progress_bar()  # a bar for writing one small file
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    GenerationConfig(eos_token_id=end).save_pretrained(directory)


USAGE = (
    "usage: python -m flashrt_build.examples [--llm] DIR  (writes a small GPT-2 as save_pretrained does;\n"
    "       --llm: a small Llama that has learned a story, with its tokenizer, for causal_lm)"
)


def main(argv: list[str]) -> int:
    """`python -m flashrt_build.examples [--llm] DIR`: the GPT-2 (the Llama) into DIR, a new or an
    empty directory; exit 2, one line, for anything else (no argument, a
    file, a directory that holds something: never written over)."""
    import sys

    if len(argv) == 1 and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    llm = argv[:1] == ["--llm"]
    if len(argv) != 1 + llm or argv[-1].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    target = Path(argv[-1])
    why = _not_writable_here(target)
    if why is not None:
        print(f"error: {target} {why}; name a new or an empty directory", file=sys.stderr)
        return 2
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: {target} cannot be created ({exc.strerror or exc}); name a new or an empty directory",
              file=sys.stderr)  # fmt: skip
        return 2
    if llm:
        save_story_llama(str(target))
        print(f"wrote {target}: build it with flashrt-build +module=causal_lm module.pretrained={target}")
        return 0
    save_gpt2_tiny(str(target))
    print(f"wrote {target}: build it with python -m flashrt_build +module=pretrained_gpt2 "
          f"module.model.pretrained_model_name_or_path={target}")  # fmt: skip
    return 0


def _not_writable_here(target: Path) -> str | None:
    """Why the GPT-2 may not be written at `target` (None: it may): its files
    would replace a model's of the same names and leave the rest beside them."""
    if target.is_symlink() and not target.exists():
        return "is a link to nothing"
    inside = enclosing_build(target)
    if inside is not None:
        return f"is inside {inside}, a build's artifact, which would then refuse to serve"
    if not target.exists():
        return None
    if not target.is_dir():
        return "exists and is not a directory"
    try:
        held = sorted(entry.name for entry in target.iterdir())
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return f"is not empty (it holds {shown}), and the example's files would replace any of the same names"
    return None


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
