"""Put a model's buffers back as they were after a forward that must leave no trace.

A forward can change a buffer in two ways: in place (BatchNorm's running statistics in train
mode, which some kernels update without bumping the tensor's version) or by reassigning it
(``self.steps = self.steps + 1`` replaces the tensor in the module's ``_buffers``, a cache is
re-registered at another length). Both are undone, and a buffer the forward added is removed.
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
    modules = list(model.modules())
    names = [set(m._buffers) for m in modules]
    saved = [
        (module, name, b, None if b.is_meta else b.detach().clone())
        for module in modules
        for name, b in module._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        for module, had in zip(modules, names):
            for name in [n for n in module._buffers if n not in had]:
                del module._buffers[name]  # added in forward
        with torch.no_grad():
            for module, name, b, values in saved:
                if module._buffers.get(name) is not b:
                    module._buffers[name] = b  # reassigned in forward: put the original back
                if values is None:
                    continue
                if b.shape != values.shape:  # resized in place
                    b.set_(values)
                elif not torch.equal(b, values):
                    b.copy_(values)
