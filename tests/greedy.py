"""The reference the serving tests compare generation with: greedy
generation written out by hand on an eager module of prefill (`forward`)
and `decode`, as `flashrt_build.generate` and `flashrt-generate` run it."""

from __future__ import annotations

import torch


def eager_greedy(module: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """`new` tokens after the prompt `ids` [batch, length], on `ids`' device."""
    with torch.no_grad():
        tokens = [module(ids)[:, -1].argmax(-1, keepdim=True)]
        for step in range(new - 1):
            position = torch.tensor([ids.shape[1] + step], device=ids.device)
            tokens.append(module.decode(tokens[-1], position)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)
