"""Text in, text out for `python -m flashrt_build.generate`: the prompt's
token ids from its text (the tokenizer the build copied, its chat template
rendered under bounds: chat_template.py) or from `--prompt-ids`, each refused
naming the flag; the continuation printed as it is generated."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, FlashrtError
from ..runtime.manifest import manifest_methods
from ..runtime.tokenizer import served_tokenizer, too_long

MAX_SEED = 2**63  # --seed is from 0 to this, less one (torch's generator takes an int64)
TOKEN_ID = re.compile(r"[+-]?[0-9]+")
MAX_PROMPT_BYTES = 64 << 20  # more text than the longest prompt a package takes


class StdoutError(FlashrtError):
    """The continuation could not be written to stdout (a full disk, an I/O
    error; a reader that closed the pipe is not one: that ends quietly)."""


def argument(flag: str, value: object, expected: str) -> ConfigError:
    """A command-line flag refused: its name, its value and what was expected (exit code 2)."""
    return ConfigError(flag, value, expected, kind="argument")


def prompt_ids(args: argparse.Namespace, manifest: dict[str, Any]) -> tuple[Any, list[int]]:
    """The tokenizer (None for --prompt-ids) and the prompt's token ids, each in the package's vocabulary."""
    if args.interactive:  # the prompts are standard input's lines, read turn by turn (chat.py)
        return served_tokenizer(args.output_dir, chat=args.chat, prompt="--interactive"), []
    if args.prompt_ids is not None:
        if args.chat:
            raise argument("--chat", True, "applies to --prompt's text; --prompt-ids are token ids already")
        ids = parse_ids(args.prompt_ids)
        check_vocabulary(ids, manifest, "--prompt-ids", args.prompt_ids)
        return None, ids
    flag, given = ("--prompt", args.prompt) if args.prompt is not None else ("--prompt-file", str(args.prompt_file))
    text = utf8(args.prompt) if args.prompt is not None else _read_prompt(args.prompt_file)
    tokenizer = served_tokenizer(args.output_dir, chat=args.chat, prompt=flag)
    check_text_length(text, tokenizer, manifest, flag, given)
    ids = _chat_ids(tokenizer, text, args.output_dir, args.system) if args.chat else encode(tokenizer, text)
    if not ids:
        raise argument(flag, given, "encodes to no tokens; the package needs at least one")
    check_vocabulary(ids, manifest, flag, text)
    return tokenizer, ids


def parse_ids(given: str) -> list[int]:
    """Token ids separated by commas, each an integer: an empty or other item
    is refused by its place, never dropped (`1,,2` is not the prompt [1, 2])."""
    items = given.split(",")
    for place, item in enumerate(items, 1):
        if not TOKEN_ID.fullmatch(item.strip()):
            what = "is empty" if not item.strip() else f"{item.strip()!r} is not an integer"
            expected = f"item {place} of {len(items)} {what}; expected token ids separated by commas (1,2,3)"
            raise argument("--prompt-ids", given, expected)
    return [int(item) for item in items]


def utf8(text: str, flag: str = "--prompt") -> str:
    """A flag's text: bytes that are not UTF-8 reach argv as surrogates, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw, at = os.fsencode(text), len(text[: exc.start].encode())
        raise argument(flag, raw, f"is not valid UTF-8 (byte {raw[at : at + 1]!r} at offset {at})") from None
    return text


def _read_prompt(path: Path) -> str:
    """--prompt-file's text: a file's, or standard input's for `-`."""
    try:
        if str(path) == "-":
            raw = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        else:
            with path.open("rb") as file:
                raw = file.read(MAX_PROMPT_BYTES + 1)
    except OSError as exc:
        raise argument("--prompt-file", str(path), f"cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_PROMPT_BYTES:  # /dev/zero: read in a bounded piece, not until memory runs out
        raise argument("--prompt-file", str(path), f"holds more than {MAX_PROMPT_BYTES >> 20} MiB, more text than "
                       "any package's prompt takes")  # fmt: skip
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argument("--prompt-file", str(path), f"is not valid UTF-8 (byte {exc.start})") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text)
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def _chat_ids(tokenizer: Any, text: str, output_dir: Path, system: str | None = None) -> list[int]:
    """The prompt as one user message (after `system`'s, when given) through
    the tokenizer's chat template."""
    messages = [{"role": "system", "content": utf8(system, "--system")}] if system is not None else []
    return chat_ids(tokenizer, [*messages, {"role": "user", "content": text}], output_dir)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], output_dir: Path) -> list[int]:
    """A conversation's messages through the tokenizer's chat template, the
    assistant's turn next, as transformers' `apply_chat_template` encodes
    it, the template rendered under bounds (chat_template.py)."""
    from .chat_template import refused, render

    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        raise argument("--chat", True, f"the tokenizer in {output_dir} has no chat template") from None
    source = _template_source(output_dir)
    rendered = render(template, messages, tokenizer.special_tokens_map, source)
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if not ids:  # the prompt is not what is empty: the template's text is
        said = "no text" if not rendered else f"{rendered[:40]!r}, which encodes to no tokens"
        raise refused(source, f"it renders {said}; the package needs at least one")
    return ids


def _template_source(output_dir: Path) -> Path:
    """The file a tokenizer's chat template comes from, as transformers looks for it."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (output_dir / name).is_file():
            return output_dir / name
    return output_dir / "tokenizer_config.json"


def check_text_length(text: str, tokenizer: Any, manifest: dict[str, Any], flag: str, given: str) -> None:
    """Text no prompt of the package could be (runtime.tokenizer.too_long), refused naming the flag."""
    why = too_long(text, tokenizer, manifest)
    if why is not None:
        shown = given if given != text else f"{text[:40]}... ({len(text)} characters)"  # a path, or the text
        raise argument(flag, shown, why)


def check_vocabulary(ids: list[int], manifest: dict[str, Any], flag: str, given: str) -> None:
    """Token ids the prefill's declared range takes (its vocabulary), before the package is loaded."""
    spec = manifest_methods(manifest)["prefill"]["inputs"][0]
    low, high = spec.get("low"), spec.get("high")
    outside = [i for i in ids if (low is not None and i < low) or (high is not None and i >= high)]
    if outside:
        accepted = f"{'-inf' if low is None else low} to {'inf' if high is None else high - 1}"
        raise argument(flag, given, f"token id {outside[0]} is outside the package's vocabulary, {accepted}")


def print_speed(prompt_tokens: int, result: Any, threads: int | None = None) -> None:
    """The prompt's and the decode's speed, the output's last line, on stderr
    (with the CPU threads the calls ran on)."""
    new = result.tokens.shape[1]
    steps = max(new - 1, 1)
    print(
        f"prompt: {prompt_tokens} tokens in {1e3 * result.prefill_s:.1f} ms "
        f"({prompt_tokens / result.prefill_s:.0f} tokens/s); decode: {new} tokens, "
        f"{1e3 * result.decode_s / steps:.2f} ms/token "
        f"({steps / result.decode_s if result.decode_s else float('inf'):.0f} tokens/s)"
        + (f"; {threads} CPU thread{'s' if threads > 1 else ''}" if threads else ""),
        file=sys.stderr,
    )


def print_json(ids: list[int], result: Any, stream: Stream, stopped: str, threads: int | None) -> None:
    """`--json`: the generation as one object on stdout, for a program to read."""
    steps = max(result.tokens.shape[1] - 1, 1)
    record = {
        "prompt_ids": ids,
        "ids": [int(t) for t in result.tokens[0].tolist()],
        "text": stream.text if stream.tokenizer is not None else None,
        "stopped": stopped,
        "seed": result.seed,
        "prefill_ms": 1e3 * result.prefill_s,
        "decode_ms_per_token": 1e3 * result.decode_s / steps,
        "threads": threads,
    }
    _write(json.dumps(record) + "\n")


class Stream:
    """Prints the continuation as tokens arrive: text decoded from all tokens
    so far, minus what was printed (a token may complete a character), or the
    ids themselves without a tokenizer. With `stops`, text that could begin
    one is held back until it cannot, and the text ends before the first one
    found (`stopped`); `quiet` prints nothing (`--json` prints at the end)."""

    def __init__(self, tokenizer: Any = None, stops: tuple[str, ...] = (), quiet: bool = False) -> None:
        self.tokenizer, self.printed = tokenizer, ""
        self.stops, self.quiet, self.stopped = stops, quiet, False
        self.text = ""  # the continuation so far (to the first stop string)
        self.ids: list[int] = []
        self.mid_line = False  # printed something the final newline has not ended
        self.started = time.perf_counter()

    def __call__(self, token: Any) -> None:
        self.ids.append(int(token[0, 0]))
        if self.tokenizer is None:
            self._print(("," if len(self.ids) > 1 else "") + str(self.ids[-1]))
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stopped or text.endswith("\ufffd") or not text.startswith(self.printed):  # half a character
            return
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        self.text = text
        shown = text if self.stopped else text[: len(text) - self._held(text)]
        if len(shown) > len(self.printed):
            self._print(shown[len(self.printed) :])
            self.printed = shown

    def is_stopped(self) -> bool:
        """Whether the text reached a stop string: generation's `stop()`."""
        return self.stopped

    def _held(self, text: str) -> int:
        """How much of the text's end could begin a stop string: not printed yet."""
        return max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

    def _print(self, text: str) -> None:
        if self.quiet:
            return
        _write(text)
        self.mid_line = self.mid_line or bool(text)

    def end(self) -> None:
        if self.tokenizer is not None and not self.stopped:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self.text = text
            self._print(text[len(self.printed) :] if text.startswith(self.printed) else "")
        if not self.quiet:
            _write("\n")
        self.mid_line = False

    def end_line(self) -> None:
        """End the continuation's line, so a message after it starts on its own."""
        if self.mid_line:
            self.mid_line = False
            _write("\n")


def _write(text: str) -> None:
    """`text` on stdout, at once; a failed write is a StdoutError naming why
    (a reader that closed the pipe stays a BrokenPipeError: that ends quietly)."""
    try:
        print(text, end="", flush=True)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise StdoutError(f"cannot write to stdout: {exc.strerror or exc}") from exc
