"""Modules the SLURM tests build (tests/slurm/conf/module/)."""

from __future__ import annotations

import time

import torch
from torch import nn


class SleepsFirst(nn.Module):
    """A Linear whose construction takes `seconds`: a build that outlasts its job's time limit."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        time.sleep(seconds)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
