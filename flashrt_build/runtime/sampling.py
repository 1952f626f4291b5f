"""How generation chooses the next token from the last position's logits:
greedy, or sampled (temperature, top-k, top-p, a seeded generator), with a
repetition penalty over the tokens seen."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

__all__ = ["chooser", "penalised"]


def system_seed() -> int:
    """A seed from the system, for sampling not seeded by the caller (said, so a run can be repeated)."""
    return int.from_bytes(os.urandom(4), "little")


def chooser(
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
        scores = _scaled(logits[:, -1], temperature)
        if top_k is not None:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p is not None:
            ordered, order = scores.sort(dim=-1, descending=True)
            before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability of the tokens above
            cut = before >= top_p
            cut[:, 0] = False  # the most likely one always stays
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered.masked_fill(cut, float("-inf")))
        return torch.multinomial(scores.softmax(-1), 1, generator=generator)

    return sample


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits over the temperature, in float64 and less their largest (0 for
    the likeliest): a temperature as small as 1e-320 (zero in float32) or a
    logit a repetition penalty made infinite gives the likeliest tokens, not
    inf - inf; a top_p as small as 1e-300 stays above zero."""
    scores = logits.double().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float64).max, neginf=float("-inf"))
    return (scores - scores.max(-1, keepdim=True).values) / temperature


def penalised(
    choose: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, penalty: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`choose` over logits in which every token seen so far (the prompt, and
    each chosen one, which it remembers) is `penalty` times less likely."""
    seen = [prompt]

    def choose_penalised(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1:].float().clone()
        ids = torch.cat(seen, dim=1)
        scores = last[:, 0].gather(1, ids)
        last[:, 0].scatter_(1, ids, torch.where(scores < 0, scores * penalty, scores / penalty))
        token = choose(last)
        seen.append(token.to(prompt.dtype))
        return token

    return choose_penalised
