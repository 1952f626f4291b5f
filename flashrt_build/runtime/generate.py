"""Generation from a package of two methods over a static KV cache: prefill
the prompt, then one decode step per new token, each reading what the calls
before it wrote into the cache; greedy by default, or sampled. The loop a serving process runs, as an
example of use and the reference for `flashrt-generate` (C++)."""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch

from .sampling import chooser, penalised, system_seed
from .sizes import PromptRefused, built_sizes, check_methods, check_request, declared_inputs, model_positions
from .tokenizer import check_serving_dir, eos_tokens, served_tokenizer, token_ids, too_long

__all__ = ["Generation", "PromptRefused", "generate", "generate_ids"]

MAX_SEED = 2**63  # seeds are from 0 to this, less one: what torch.Generator.manual_seed takes as an int64


@dataclass
class Generation:
    """The tokens generated (without the prompt), [batch, n], and where the
    time went (when timed): until the first token was on the host, then the
    decode steps together (queued back to back, waited for once at the end)."""

    tokens: torch.Tensor
    prefill_s: float = 0.0
    decode_s: float = 0.0
    seed: int | None = None  # what sampling was seeded with (None: greedy); passed again, the same tokens
    stopped: str = "length"  # why it stopped: "length" (max_new_tokens), "eos", or "stop" (the caller's `stop`)

    @property
    def decode_ms_per_token(self) -> float:
        steps = self.tokens.shape[1] - 1
        return 1e3 * self.decode_s / steps if steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole time, prefill included (what a user waits for)."""
        total = self.prefill_s + self.decode_s
        return self.tokens.shape[1] / total if total else float("inf")


@overload
def generate(model: Any, prompt: str, max_new_tokens: int = 64, **options: Any) -> str: ...
@overload
def generate(model: Any, prompt: list[int], max_new_tokens: int = 64, **options: Any) -> list[int]: ...
@overload
def generate(model: Any, prompt: torch.Tensor, max_new_tokens: int = 64, **options: Any) -> Generation: ...
def generate(model: Any, prompt: Any, max_new_tokens: int = 64, **options: Any) -> Any:
    """Text in, text out: `generate(OUTPUT_DIR or a loaded package, "Once
    upon a time", 32)` encodes the prompt with the tokenizer the build copied
    beside the package (its files checked first), stops at the model's
    end-of-sequence tokens, and returns the continuation's text; a list of
    token ids returns the new ids. A tensor [batch, length] of ids returns a
    `Generation` (`generate_ids`: its options, and what it returns)."""
    if isinstance(model, (str, Path)):
        from .load import load

        model = load(model)
    if isinstance(prompt, torch.Tensor):
        return generate_ids(model, prompt, max_new_tokens, **options)
    if not hasattr(model, "output_dir"):  # text and ids need the files beside the package
        raise TypeError(
            f"model: expected an output directory or a loaded package (flashrt_build.load(OUT)), "
            f"got {type(model).__name__}"
        )
    output_dir = Path(model.output_dir)
    tokenizer = None
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer encodes it
            where = f"{prompt[exc.start]!r} (character {exc.start})"
            raise ValueError(f"prompt: not text: {where} is a lone surrogate") from None
        check_serving_dir(output_dir, model.manifest)
        tokenizer = served_tokenizer(output_dir)
        why = too_long(prompt, tokenizer, model.manifest)
        if why is not None:
            raise ValueError(f"prompt: {why}")
        encoded = tokenizer.encode(prompt)
        prompt = list(encoded.ids if hasattr(encoded, "ids") else encoded)
    elif not isinstance(prompt, list):
        raise TypeError(f"prompt: expected text, a list of token ids or a tensor of them, got {type(prompt).__name__}")
    else:
        try:
            prompt = token_ids(prompt) if prompt else None
        except TypeError:
            prompt = None
        if prompt is None:
            raise ValueError("prompt: expected at least one token id, each an integer from 0 to 2**63 - 1")
    options.setdefault("eos", eos_tokens(output_dir, tokenizer))
    ids = torch.tensor([prompt], dtype=torch.int64, device=model.device)
    new = generate_ids(model, ids, max_new_tokens, **options).tokens[0].tolist()
    return new if tokenizer is None else tokenizer.decode(new, skip_special_tokens=True)


def generate_ids(
    model: Any,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    prefill: str = "prefill",
    decode: str = "decode",
    position: str = "position",
    eos: int | Collection[int] | None = None,
    timed: bool = False,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float = 1.0,
    on_token: Callable[[torch.Tensor], None] | None = None,
    stop: Callable[[], bool] | None = None,
    cached: int = 0,
) -> Generation:
    """Generation through a prefill and a decode method: `model.<prefill>(prompt)`
    gives the logits of every prompt position, the last one's choice is the
    first new token; each next one is chosen from `model.<decode>(token, position=p)`.

    Stops after `max_new_tokens`, or once every sequence produced one of `eos`.
    `temperature` 0 is greedy; above, it samples from the `top_k` likeliest and
    the fewest reaching `top_p`, seeded by `seed`, else from the system
    (`Generation.seed` says which, to repeat a run). `repetition_penalty`
    above 1 makes every token the sequence holds less likely, as
    transformers' does. `on_token(token [batch, 1])` sees each token as
    chosen (streaming), and `stop()`, asked after it, ends the generation
    when true (a stop string the caller saw); `timed` waits for the device to
    time prefill and decode. `cached`: the prompt's first tokens the cache
    holds already (a conversation's earlier turns): the rest are decoded one
    at a time from there instead of prefilled.
    """
    _check_options(seed, on_token=on_token, stop=stop)
    _check_fits(model, prompt, max_new_tokens, (prefill, decode, position), cached)
    seed = system_seed() if temperature > 0 and seed is None else seed
    choose = _choosing(prompt, temperature, top_k, top_p, seed, repetition_penalty)
    check_methods(model, prefill=prefill, decode=decode)
    ends = _ends(eos, prompt.device)
    wait = torch.cuda.synchronize if timed and prompt.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        start = time.perf_counter()
        if cached:
            logits = _fed(getattr(model, decode), position, prompt, cached)
        else:
            logits = _logits(getattr(model, prefill)(prompt))
        token = choose(logits).to(prompt.dtype)
        wait()
        prefill_s, start = time.perf_counter() - start, time.perf_counter()
        steps = _Steps(_trusted(getattr(model, decode), model, decode, logits.shape[-1]), position, choose,
                       on_token or (lambda token: None), stop, ends)  # fmt: skip
        steps.notify(token)
        tokens, stopped = steps.run(token, prompt.shape[1], max_new_tokens)
        wait()
        decode_s = time.perf_counter() - start if len(tokens) > 1 else 0.0
    result = Generation(torch.cat(tokens, dim=1), seed=seed if temperature > 0 else None, stopped=stopped)
    result.prefill_s, result.decode_s = (prefill_s, decode_s) if timed else (result.prefill_s, result.decode_s)
    return result


def _choosing(
    prompt: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, seed: int | None, penalty: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """How each next token is chosen (sampling.py), the repetition penalty over the prompt's tokens and those after."""
    if not (math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"repetition_penalty = {penalty!r}: expected a finite number > 0 (1: none)")
    choose = chooser(temperature, top_k, top_p, seed, prompt.device)
    return penalised(choose, prompt, penalty) if penalty != 1.0 else choose


def _check_options(seed: Any, **callbacks: Any) -> None:
    """The callbacks (`on_token`, `stop`) are functions (the command line's
    --stop takes text; these, functions); a seed is one torch's generator
    takes, refused naming `seed` (an int64 that does not fit raised torch's
    own "Overflow when unpacking long long")."""
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise TypeError(f"{name}: expected a function (or None), got {type(value).__name__} {value!r}")
    if seed is None:
        return
    try:
        value = operator.index(seed) if not isinstance(seed, bool) else None
    except TypeError:
        value = None
    if value is None or not 0 <= value < MAX_SEED:
        raise ValueError(f"seed = {seed!r}: expected an integer with 0 <= seed < 2**63")


def _check_fits(
    model: Any, prompt: torch.Tensor, max_new_tokens: int, names: tuple[str, str, str], cached: int = 0
) -> None:
    """The prompt and the new tokens fit the package, before any call."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [batch, length] token ids, got shape {list(prompt.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < prompt.shape[1]:
        raise ValueError(f"cached = {cached!r}: expected 0 <= cached < the prompt's {prompt.shape[1]} tokens")
    prefill, decode, position = names
    sizes = built_sizes(model, prefill, decode, position)
    if sizes is not None:  # a causal_lm package: the keys a user sets, not the inputs they derive
        manifest = getattr(model, "manifest", None) or {}
        check_request(sizes, prompt.shape[0], prompt.shape[1], max_new_tokens, lambda: model_positions(manifest),
                      prefilled=not cached)  # fmt: skip
    _check_room(model, decode, position, prompt.shape[1] + max_new_tokens - 1)


def _fed(call: Callable[..., Any], position: str, prompt: torch.Tensor, cached: int) -> torch.Tensor:
    """The prompt's tokens past `cached` through decode, each at its position
    (writing the cache there): the logits after the last."""
    logits = None
    for at in range(cached, prompt.shape[1]):
        where = torch.full((prompt.shape[0],), at, dtype=torch.int64, device=prompt.device)
        logits = _logits(call(prompt[:, at : at + 1], **{position: where}))
    assert logits is not None  # cached < the prompt's length: checked first
    return logits


def _ends(eos: int | Collection[int] | None, device: torch.device) -> torch.Tensor | None:
    """The end-of-sequence token ids as a tensor on `device`; a ValueError naming `eos` for anything else."""
    try:
        return None if eos is None else torch.tensor(token_ids(eos), dtype=torch.int64, device=device)
    except TypeError:
        raise ValueError(f"eos = {eos!r}: expected a token id or a collection of them (integers), or None") from None


@dataclass
class _Steps:
    """The decode steps after prefill's token: each at the next position, its
    token chosen, seen (`notify`), until `max_new_tokens`, every sequence's
    end-of-sequence token (`eos`), or the caller's `stop()`."""

    call: Callable[..., Any]
    position: str
    choose: Callable[[torch.Tensor], torch.Tensor]
    notify: Callable[[torch.Tensor], None]
    stop: Callable[[], bool] | None
    eos: torch.Tensor | None

    def run(self, token: torch.Tensor, length: int, max_new_tokens: int) -> tuple[list[torch.Tensor], str]:
        tokens, ends = [token], self.eos
        done = torch.isin(token, ends) if ends is not None else None
        for step in range(1, max_new_tokens + 1):
            if done is not None and bool(done.all()):
                return tokens, "eos"
            if self.stop is not None and self.stop():
                return tokens, "stop"
            if step == max_new_tokens:
                break
            at = torch.full((token.shape[0],), length + step - 1, dtype=torch.int64, device=token.device)
            token = self.choose(_logits(self.call(token, **{self.position: at}))).to(token.dtype)
            tokens.append(token)
            self.notify(token)
            if done is not None and ends is not None:
                done |= torch.isin(token, ends)
        return tokens, "length"


def _logits(out: Any) -> torch.Tensor:
    """The logits of a method's output: a tensor, a ModelOutput's `logits`, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def _trusted(run_decode: Any, model: Any, decode: str, width: int) -> Any:
    """The decode call to make each step: without the value check (which
    waits for the device) when every token it can be given, an argmax over
    `width` logits, is within its declared range; positions are checked once,
    up front, by `_check_room`."""
    if not hasattr(run_decode, "run_trusted"):
        return run_decode
    token = (declared_inputs(model, decode) or [{}])[0]
    if token.get("high") is not None and width > token["high"]:
        return run_decode
    return run_decode.run_trusted


def _check_room(model: Any, decode: str, position: str, last: int) -> None:
    """A position the decode method does not accept is an error before any call, not after half the tokens."""
    spec = next((i for i in declared_inputs(model, decode) if i["name"] == position), None)
    if spec is not None and spec.get("high") is not None and last >= spec["high"]:
        raise ValueError(
            f"the prompt and the new tokens need positions up to {last}; the package's {decode} accepts "
            f"{position} below {spec['high']} (module.methods.{decode}.inputs.{position}.high: its cache's length)"
        )
