"""Greedy generation from a package of two methods over a static KV cache:
prefill the prompt, then one decode step per new token, each reading what the
calls before it wrote into the cache. The loop a serving process runs, as an
example of use and the reference for `flashrt-generate` (C++)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Generation:
    """The tokens generated (without the prompt), [batch, n], and where the
    time went (when timed): until the first token was on the host, then the
    decode steps together (queued back to back, waited for once at the end)."""

    tokens: torch.Tensor
    prefill_s: float = 0.0
    decode_s: float = 0.0

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
    eos: int | None = None,
    timed: bool = False,
) -> Generation:
    """Greedy generation: `model.<prefill>(prompt)` gives the logits of every
    prompt position, the argmax of the last is the first new token; each
    further token is the argmax of `model.<decode>(token, position=p)`.

    `model`: a loaded package (or any module with the two methods). Stops
    after `max_new_tokens`, or once every sequence has produced `eos`.
    `timed`: wait for the device to time the prefill and the decode steps.
    """
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [batch, length] token ids, got shape {list(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    run_prefill, run_decode = getattr(model, prefill), getattr(model, decode)
    length = prompt.shape[1]
    _check_room(model, decode, position, length + max_new_tokens - 1)
    wait = torch.cuda.synchronize if timed and prompt.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        start = time.perf_counter()
        logits = _logits(run_prefill(prompt))
        token = _next(logits, prompt.dtype)
        wait()
        prefill_s, start = time.perf_counter() - start, time.perf_counter()
        tokens = [token]
        step_call = _trusted(run_decode, model, decode, logits.shape[-1])
        done = token.eq(eos) if eos is not None else None
        for step in range(1, max_new_tokens):
            if done is not None and bool(done.all()):
                break
            at = torch.full((prompt.shape[0],), length + step - 1, dtype=torch.int64, device=prompt.device)
            token = _next(step_call(token, **{position: at}), prompt.dtype)
            tokens.append(token)
            if done is not None:
                done |= token.eq(eos)
        wait()
        decode_s = time.perf_counter() - start if len(tokens) > 1 else 0.0
    result = Generation(torch.cat(tokens, dim=1))
    if timed:
        result.prefill_s, result.decode_s = prefill_s, decode_s
    return result


def _next(out: Any, dtype: torch.dtype) -> torch.Tensor:
    """The next token of each sequence, [batch, 1]: the argmax of the last position's logits."""
    return _logits(out)[:, -1].argmax(-1, keepdim=True).to(dtype)


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
