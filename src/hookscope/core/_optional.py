"""Optional dependencies, imported when a feature needs them, with one line naming the extra."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["need"]


def need(module: str, extra: str, what: str = "this") -> Any:
    """Import ``module``, or raise an ``ImportError`` of one line naming ``pip install
    'hookscope[extra]'``.

    Example:
        >>> from hookscope.core._optional import need
        >>> need("math", "viz").sqrt(4.0)
        2.0
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise ImportError(
            f"{what} needs {top}, which is not installed: pip install 'hookscope[{extra}]'"
        ) from None
