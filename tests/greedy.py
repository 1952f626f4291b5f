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


def train_on_a_cycle(module: torch.nn.Module, steps: int = 400, seed: int = 0) -> torch.Tensor:
    """Train a TinyLM (float32, in place) on a language of one rule, `next =
    cycle[token]` for a random permutation `cycle`, which it returns. A
    randomly initialised model's logits are near-ties that one rounding
    flips; a trained model's greedy tokens are decided, so in bf16 they can
    be compared with eager's exactly."""
    generator = torch.Generator().manual_seed(seed)
    vocab, length, device = module.embed.num_embeddings, module.kv_cache.shape[4], module.kv_cache.device
    cycle = torch.randperm(vocab, generator=generator)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    module.train()
    for _ in range(steps):
        tokens = [torch.randint(0, vocab, (1,), generator=generator)]
        for _ in range(length - 1):
            tokens.append(cycle[tokens[-1]])
        sequence = torch.cat(tokens).view(1, -1).to(device)
        logits = module(sequence[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0], sequence[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        module.kv_cache.detach_().zero_()  # prefill wrote it; the next step must not backpropagate through it
    module.eval()
    return cycle
