"""Put a model's buffers back as they were after a forward that must leave no trace.

A forward can change a buffer in two ways: in place (BatchNorm's running statistics in train
mode, which some kernels update without bumping the tensor's version) or by reassigning it
(``self.steps = self.steps + 1`` replaces the tensor in the module's ``_buffers``). Both are undone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["buffers_kept"]


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``model`` on exit: the same tensor object, with the same values.

    Example:
        >>> import torch, torch.nn as nn
        >>> bn = nn.BatchNorm1d(2)
        >>> with buffers_kept(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.num_batches_tracked.item(), bn.running_mean.tolist()
        (0, [0.0, 0.0])
    """
    saved = [
        (module, name, b, None if b.is_meta else b.detach().clone())
        for module in model.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, b, values in saved:
                if module._buffers.get(name) is not b:
                    module._buffers[name] = b  # reassigned in forward: put the original back
                if values is not None and not torch.equal(b, values):
                    b.copy_(values)
