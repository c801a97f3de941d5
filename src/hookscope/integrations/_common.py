"""What the trainer callbacks share: the missing-extra message and the optimizer a monitor reads."""

from __future__ import annotations

from typing import Any

from ..core._optional import need as _need

__all__ = ["inner_optimizer", "need"]


def need(module: str, extra: str) -> Any:
    """Import the host framework ``module`` or raise one line naming the pip install."""
    return _need(module, extra, "this integration")


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's/Accelerate's wrappers (a GradScaler keys its state
    by the inner optimizer)."""
    while getattr(optimizer, "optimizer", optimizer) is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer
