"""Small modules that live in the repo, used by the shipped configs and tests."""

from __future__ import annotations

import torch
from torch import nn


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
