"""`python -m flashrt_build.generate OUTPUT_DIR --prompt TEXT`: text in, text
out, from a package of a prefill and a decode method (`causal_lm`'s).

The prompt is encoded with the tokenizer the build copied beside the package
(transformers' `AutoTokenizer` when installed, else the `tokenizers` library
for a `tokenizer.json`); `--chat` applies its chat template. The continuation
is printed as it is generated, generation stops at the model's end-of-sequence
tokens (its generation_config.json), and the prompt's and the decode's speed
end the output on stderr. `--prompt-ids 1,2,3` serves a package without a
tokenizer, printing token ids. Exit 0 done; 1 the package or a call failed;
2 a wrong command line (no tokenizer for --prompt, a prompt too long).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import FlashrtError


def main(argv: list[str] | None = None) -> int:
    """`python -m flashrt_build.generate OUTPUT_DIR (--prompt TEXT | --prompt-ids IDS) [options]`."""
    parser = argparse.ArgumentParser(prog="python -m flashrt_build.generate", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the prompt's text (needs the tokenizer the build copied)")
    given.add_argument("--prompt-ids", help="the prompt's token ids, comma-separated (1,2,3)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling: the same tokens every run")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    parser.add_argument("--device", default=None, help="default: the build's target")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError) as exc:  # a prompt the package does not take, a sampling setting
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FlashrtError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _generate(args: argparse.Namespace) -> int:
    import torch

    from ..runtime.generate import generate
    from ..runtime.load import load

    tokenizer = _tokenizer(args.output_dir) if args.prompt is not None else None
    if args.prompt is not None and tokenizer is None:
        raise ValueError(f"{args.output_dir} holds no tokenizer (tokenizer.json): give --prompt-ids instead")
    if args.chat and not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("--chat needs a chat template and transformers' tokenizer: pip install transformers")
    model = load(args.output_dir, device=args.device)
    if args.prompt_ids is not None:
        ids = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
    elif args.chat:
        assert tokenizer is not None  # --chat needs --prompt, and a tokenizer (checked above)
        ids = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_dict=False
            )
        )
    else:
        ids = _encode(tokenizer, args.prompt)
    prompt = torch.tensor([ids], dtype=torch.int64, device=model.device)
    stream = _Stream(tokenizer)
    result = generate(
        model,
        prompt,
        args.max_new_tokens,
        eos=_eos(args.output_dir, tokenizer),
        timed=True,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        on_token=stream,
    )
    stream.end()
    new = result.tokens.shape[1]
    steps = max(new - 1, 1)
    print(
        f"prompt: {len(ids)} tokens in {1e3 * result.prefill_s:.1f} ms ({len(ids) / result.prefill_s:.0f} tokens/s); "
        f"decode: {new} tokens, {1e3 * result.decode_s / steps:.2f} ms/token "
        f"({steps / result.decode_s if result.decode_s else float('inf'):.0f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _tokenizer(output_dir: Path) -> Any:
    """The tokenizer the build copied: transformers' when installed (chat
    templates, every tokenizer kind), else a tokenizer.json through the
    `tokenizers` library; None when there is none."""
    if not any((output_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(output_dir, local_files_only=True)
    except ImportError:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(output_dir / "tokenizer.json"))


def _encode(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text)
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def _eos(output_dir: Path, tokenizer: Any) -> set[int] | None:
    """The model's end-of-sequence tokens: its generation config's, else its tokenizer's."""
    path = output_dir / "generation_config.json"
    if path.is_file():
        found = json.loads(path.read_text()).get("eos_token_id")
        if found is not None:
            return set(found) if isinstance(found, list) else {int(found)}
    found = getattr(tokenizer, "eos_token_id", None)
    return {int(found)} if found is not None else None


class _Stream:
    """Prints the continuation as tokens arrive: text decoded from all tokens
    so far, minus what was printed (a token may complete a character), or the
    ids themselves without a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.printed = tokenizer, ""
        self.ids: list[int] = []
        self.started = time.perf_counter()

    def __call__(self, token: Any) -> None:
        self.ids.append(int(token[0, 0]))
        if self.tokenizer is None:
            print(("," if len(self.ids) > 1 else "") + str(self.ids[-1]), end="", flush=True)
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):  # not half a character
            print(text[len(self.printed) :], end="", flush=True)
            self.printed = text

    def end(self) -> None:
        if self.tokenizer is not None:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            print(text[len(self.printed) :] if text.startswith(self.printed) else "", end="")
        print(flush=True)
