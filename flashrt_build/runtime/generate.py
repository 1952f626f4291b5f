"""Generation from a package of two methods over a static KV cache: prefill
the prompt, then one decode step per new token, each reading what the calls
before it wrote into the cache; greedy by default, or sampled. The loop a serving process runs, as an
example of use and the reference for `flashrt-generate` (C++)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError


class PromptRefused(ConfigError, ValueError):
    """A prompt, or a number of new tokens, the package was not built for:
    the config key that would build one that takes it, with the value this
    package was built with (exit code 2 from the command line; a ValueError
    to callers of `generate`)."""


@dataclass
class Generation:
    """The tokens generated (without the prompt), [batch, n], and where the
    time went (when timed): until the first token was on the host, then the
    decode steps together (queued back to back, waited for once at the end)."""

    tokens: torch.Tensor
    prefill_s: float = 0.0
    decode_s: float = 0.0
    seed: int | None = None  # what sampling was seeded with (None: greedy); passed again, the same tokens

    @property
    def decode_ms_per_token(self) -> float:
        steps = self.tokens.shape[1] - 1
        return 1e3 * self.decode_s / steps if steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole time, prefill included (what a user waits for)."""
        total = self.prefill_s + self.decode_s
        return self.tokens.shape[1] / total if total else float("inf")


def generate(
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
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> Generation:
    """Generation through a prefill and a decode method: `model.<prefill>(prompt)`
    gives the logits of every prompt position, the last one's choice is the
    first new token; each next one is chosen from `model.<decode>(token, position=p)`.

    Stops after `max_new_tokens`, or once every sequence produced one of `eos`.
    `temperature` 0 is greedy; above, it samples from the `top_k` likeliest and
    the fewest reaching `top_p`, seeded by `seed`, else from the system (each
    run its own tokens; `Generation.seed` says which, to repeat one).
    `on_token(token [batch, 1])` sees each token as chosen (streaming: a wait
    per step); `timed` waits for the device to time prefill and decode.
    """
    _check_fits(model, prompt, max_new_tokens, (prefill, decode, position))
    if temperature > 0 and seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    choose = _chooser(temperature, top_k, top_p, seed, prompt.device)
    notify = on_token or (lambda token: None)
    length = prompt.shape[1]
    stops = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), device=prompt.device)
    wait = torch.cuda.synchronize if timed and prompt.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        start = time.perf_counter()
        logits = _logits(getattr(model, prefill)(prompt))
        token = choose(logits).to(prompt.dtype)
        wait()
        prefill_s, start = time.perf_counter() - start, time.perf_counter()
        tokens = [token]
        notify(token)
        step_call = _trusted(getattr(model, decode), model, decode, logits.shape[-1])
        done = torch.isin(token, stops)
        for step in range(1, max_new_tokens):
            if eos is not None and bool(done.all()):
                break
            at = torch.full((prompt.shape[0],), length + step - 1, dtype=torch.int64, device=prompt.device)
            token = choose(_logits(step_call(token, **{position: at}))).to(prompt.dtype)
            tokens.append(token)
            notify(token)
            done |= torch.isin(token, stops)
        wait()
        decode_s = time.perf_counter() - start if len(tokens) > 1 else 0.0
    result = Generation(torch.cat(tokens, dim=1), seed=seed if temperature > 0 else None)
    if timed:
        result.prefill_s, result.decode_s = prefill_s, decode_s
    return result


def _check_fits(model: Any, prompt: torch.Tensor, max_new_tokens: int, names: tuple[str, str, str]) -> None:
    """The prompt and the new tokens fit the package, before any call."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [batch, length] token ids, got shape {list(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prefill, decode, position = names
    sizes = built_sizes(model, prefill, decode, position)
    if sizes is not None:  # a causal_lm package: the keys a user sets, not the inputs they derive
        check_request(sizes, prompt.shape[0], prompt.shape[1], max_new_tokens)
    _check_room(model, decode, position, prompt.shape[1] + max_new_tokens - 1)


def _chooser(
    temperature: float, top_k: int | None, top_p: float | None, seed: int | None, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """How the next token of each sequence, [batch, 1], is chosen from the last position's logits."""
    finite = math.isfinite(temperature) and temperature >= 0
    if not finite or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(
            f"expected a finite temperature >= 0, top_k >= 1 and 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}"
        )
    if temperature == 0:
        return lambda logits: logits[:, -1].argmax(-1, keepdim=True)
    generator = torch.Generator(device=device)
    assert seed is not None  # drawn by `generate` when not given
    generator.manual_seed(seed)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = logits[:, -1].float() / temperature
        if top_k is not None:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p is not None:
            ordered, order = scores.sort(dim=-1, descending=True)
            before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability of the tokens above
            ordered = ordered.masked_fill(before >= top_p, float("-inf"))  # the most likely one always stays
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
        return torch.multinomial(scores.softmax(-1), 1, generator=generator)

    return sample


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
    token = (_declared_inputs(model, decode) or [{}])[0]
    if token.get("high") is not None and width > token["high"]:
        return run_decode
    return run_decode.run_trusted


def _declared_inputs(model: Any, method: str) -> list[dict[str, Any]]:
    """A loaded package's manifest entries of `method`'s inputs (none for another module)."""
    methods = getattr(model, "manifest", {}).get("methods") or {}
    return (methods.get(method) or {}).get("inputs") or []


def _check_room(model: Any, decode: str, position: str, last: int) -> None:
    """A position the decode method does not accept is an error before any call, not after half the tokens."""
    spec = next((i for i in _declared_inputs(model, decode) if i["name"] == position), None)
    if spec is not None and spec.get("high") is not None and last >= spec["high"]:
        raise ValueError(
            f"the prompt and the new tokens need positions up to {last}; the package's {decode} accepts "
            f"{position} below {spec['high']} (module.methods.{decode}.inputs.{position}.high: its cache's length)"
        )


# The keys of the shipped `causal_lm` config a user sets for a package's sizes
# (the manifest's `config.module`, `pretrained` set): its prompts and cache are refused in their words.
CAUSAL_LM_KEYS = ("pretrained", "max_cache_len", "max_prompt", "batch")


@dataclass(frozen=True)
class BuiltSizes:
    """What a `causal_lm` package was built to take, read from its methods'
    inputs (the resolved values, whatever the config left null)."""

    batch: int
    max_prompt: int
    max_cache_len: int


def built_sizes(model: Any, prefill: str, decode: str, position: str) -> BuiltSizes | None:
    """A `causal_lm` package's sizes; None for any other model (its inputs' own keys apply)."""
    module = ((getattr(model, "manifest", None) or {}).get("config") or {}).get("module") or {}
    if not all(key in module for key in CAUSAL_LM_KEYS) or not module["pretrained"]:
        return None  # every module's config has the keys; only causal_lm's names a directory
    prompt = next(iter(_declared_inputs(model, prefill)), None)
    at = next((i for i in _declared_inputs(model, decode) if i["name"] == position), None)
    if prompt is None or at is None or at.get("high") is None or len(prompt["shape"]) != 2:
        return None
    longest = (prompt["dynamic"].get("1") or {}).get("max", prompt["shape"][1])
    return BuiltSizes(prompt["shape"][0], longest, at["high"])


def check_request(sizes: BuiltSizes, batch: int, length: int, max_new_tokens: int) -> None:
    """A `causal_lm` package's prompt and new tokens against what it was
    built for, refused naming `module.batch`, `module.max_prompt` or
    `module.max_cache_len` with the override that would build one that takes them."""
    if batch != sizes.batch:
        raise PromptRefused(
            "module.batch",
            sizes.batch,
            f"the package decodes {sizes.batch} sequence(s) at once and the prompt holds {batch}; "
            f"rebuild with module.batch={batch}",
        )
    last = length + max_new_tokens - 1  # the position of the last new token
    if length > sizes.max_prompt:
        cache = f" module.max_cache_len={last + 1}" if last >= sizes.max_cache_len else ""
        raise PromptRefused(
            "module.max_prompt",
            sizes.max_prompt,
            f"the prompt has {length} tokens, more than the package's prefill takes; "
            f"rebuild with module.max_prompt={length}{cache}",
        )
    if last >= sizes.max_cache_len:
        fewer = sizes.max_cache_len - length
        instead = f", or ask for at most {fewer} new tokens" if fewer >= 1 else ""
        raise PromptRefused(
            "module.max_cache_len",
            sizes.max_cache_len,
            f"the prompt ({length} tokens) and {max_new_tokens} new tokens need positions up to {last}, "
            f"the package's cache holds {sizes.max_cache_len}; rebuild with module.max_cache_len={last + 1}{instead}",
        )
