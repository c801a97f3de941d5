"""What the compiled-model audit tests share: Dynamo reset around each test, and a two-layer net."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch._dynamo as dynamo
import torch.nn as nn


def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches reset before and after a test (use as an autouse fixture)."""
    dynamo.reset()
    yield
    dynamo.reset()


class TwoLayer(nn.Module):
    """a: Linear(4, 6) -> relu -> b: Linear(6, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))
