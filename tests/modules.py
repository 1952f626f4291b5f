"""Modules that exist to exercise failure paths; importable as `modules.X`."""

from __future__ import annotations

import torch
from torch import nn


class DataDependentBranch(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class RaisesInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("this constructor always fails")


class TwoInputs(nn.Module):
    """Positional and keyword inputs, two outputs in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.fc(x)
        return {"y": y, "scaled": y * scale}


class CountsCalls(nn.Module):
    """Python-side bookkeeping that must step aside while exporting."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import flashrt_build

        if not flashrt_build.is_exporting():
            self.calls += 1
        return self.fc(x)
