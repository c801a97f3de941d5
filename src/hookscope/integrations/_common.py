"""What the trainer callbacks share: the missing-extra message and the optimizer a monitor reads."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["inner_optimizer", "need"]


def need(module: str, extra: str) -> Any:
    """Import ``module`` or raise one line naming the pip install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"this integration needs {module}, which is not installed: "
            f"pip install 'hookscope[{extra}]'"
        ) from None


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's/Accelerate's wrappers (a GradScaler keys its state
    by the inner optimizer)."""
    while getattr(optimizer, "optimizer", optimizer) is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer
