"""`python -m flashrt_build.generate OUT --interactive [--chat]`: a
conversation, a turn a line of standard input, the package's KV cache kept
between turns. Each turn's prompt is the whole conversation (through the
chat template with `--chat`, else its text joined by newlines); the tokens
the cache holds already are not computed again: only those past the part it
shares with the last turn's are decoded, one a step, from where that turn
ended. `/reset` starts over; end of input (Ctrl-D) ends the conversation."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NamedTuple

from ..errors import ConfigError
from ..runtime.sampling import system_seed
from ..runtime.sizes import PromptRefused
from .text import MAX_PROMPT_BYTES, Stream, chat_ids, check_text_length, check_vocabulary, encode, utf8

RESET = "/reset"


class Conversation:
    """What was said so far, and the token ids the package's cache holds."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer, self.args = tokenizer, args
        self.reset()

    def reset(self) -> None:
        self.cached: list[int] = []
        self.text = ""
        system = self.args.system
        self.messages = [{"role": "system", "content": utf8(system, "--system")}] if system is not None else []

    def prompt(self, line: str) -> list[int]:
        """The conversation with `line` as the user's next turn, as token ids."""
        if self.args.chat:
            return chat_ids(self.tokenizer, [*self.messages, {"role": "user", "content": line}], self.args.output_dir)
        return encode(self.tokenizer, f"{self.text}\n{line}" if self.text else line)

    def said(self, line: str, ids: list[int], reply_ids: list[int], reply: str) -> None:
        """The turn is over: the cache holds its prompt and every reply token
        but the last (chosen, never decoded)."""
        self.cached = ids + reply_ids[:-1]
        if self.args.chat:
            self.messages += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
        else:
            self.text = f"{self.text}\n{line}{reply}" if self.text else f"{line}{reply}"

    def shared(self, ids: list[int]) -> int:
        """How many of the prompt's first tokens the cache holds already."""
        count = len(os.path.commonprefix([self.cached, ids]))  # a common prefix of any two sequences
        return min(count, len(ids) - 1)  # the last one is decoded: its logits choose the first new token


def converse(args: argparse.Namespace, model: Any, tokenizer: Any, run: Any, room: Any, **options: Any) -> int:
    """The conversation's loop: `run` is `generate`, `room(model, prompt_length, asked)`
    the new tokens that fit after a prompt (and why fewer), `options` the generation's."""
    conversation = Conversation(tokenizer, args)
    if options.get("temperature", 0) > 0 and options.get("seed") is None:  # one seed the whole conversation
        options["seed"] = system_seed()
        print(f"seed: {options['seed']} (--seed {options['seed']} repeats this conversation)", file=sys.stderr)
    for line in _turns():
        if not isinstance(line, str):
            print(f"that line {line.why}, so it was not said; type it again", file=sys.stderr)
            continue
        if line.strip() == RESET:
            conversation.reset()
            print("(the conversation starts over)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        try:
            check_text_length(line, tokenizer, model.manifest, "--interactive", line)
        except ConfigError as refused:
            print(f"that line {refused.expected}, so it was not said", file=sys.stderr)
            continue
        ids = conversation.prompt(line)
        check_vocabulary(ids, model.manifest, "--interactive", line)
        cached = conversation.shared(ids)
        try:
            new, full = room(model, len(ids), args.max_new_tokens, decoded=cached > 0)
            prompt = _tensor(ids, model.device)
            stream = Stream(tokenizer, tuple(args.stop))
            result = run(model, prompt, new, cached=cached, timed=True, on_token=stream, stop=stream.is_stopped,
                         **options)  # fmt: skip
        except PromptRefused as refused:  # the conversation outgrew the package: say so, keep listening
            print(f"the conversation no longer fits: {refused}; {RESET} starts over", file=sys.stderr)
            continue
        stream.end()
        conversation.said(line, ids, [int(t) for t in result.tokens[0].tolist()], stream.text)
        _report(len(ids), cached, result, full if result.stopped == "length" and new < args.max_new_tokens else None)
    return 0


class Unsaid(NamedTuple):
    why: str  # a line of standard input that is no turn: why


def _turns() -> Any:
    """Lines of standard input (an `Unsaid` for one that is not UTF-8 text or
    is longer than any prompt), a prompt on stderr before each where a person
    types them."""
    typing = sys.stdin.isatty()
    while True:
        if typing:
            print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline(MAX_PROMPT_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_PROMPT_BYTES:  # read past in bounded pieces, never held whole
            while raw and not raw.endswith(b"\n"):
                raw = sys.stdin.buffer.readline(MAX_PROMPT_BYTES)
            yield Unsaid(f"is longer than {MAX_PROMPT_BYTES >> 20} MiB, more text than any package's prompt takes")
            continue
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            yield Unsaid("is not UTF-8 text")


def _tensor(ids: list[int], device: Any) -> Any:
    import torch

    return torch.tensor([ids], dtype=torch.int64, device=device)


def _report(length: int, cached: int, result: Any, full: str | None) -> None:
    new = result.tokens.shape[1]
    steps = max(new - 1, 1)
    said = f"{cached} of them cached, {length - cached} decoded" if cached else "prefilled"
    print(
        f"[{length} prompt tokens, {said} in {1e3 * result.prefill_s:.1f} ms; {new} new, "
        f"{1e3 * result.decode_s / steps:.2f} ms/token]",
        file=sys.stderr,
    )
    if full is not None:
        print(f"stopped at the cache's end: {full}", file=sys.stderr)
