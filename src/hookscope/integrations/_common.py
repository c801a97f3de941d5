"""What the trainer callbacks share: the missing-extra message."""

from __future__ import annotations

from typing import Any

from ..core._optional import need as _need

__all__ = ["need"]


def need(module: str, extra: str) -> Any:
    """Import the host framework ``module`` or raise one line naming the pip install."""
    return _need(module, extra, "this integration")
