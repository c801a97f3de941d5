"""Small deterministic models for the summary golden files (loaded by the CLI as file.py:Name)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Net(nn.Module):
    """Conv net with a reused ReLU, a nested block and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.act(self.bn(self.conv(x)))
        x = self.act(self.block(x))
        return {"logits": self.head(self.pool(x).flatten(1)), "features": x}


class TiedLM(nn.Module):
    """Embedding and output layer sharing one weight (the classic tied-weights case)."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.embed(ids))))


class Broken(Net):
    """Fails in ``head``: it expects 9 features and gets 8."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(9, 4)
