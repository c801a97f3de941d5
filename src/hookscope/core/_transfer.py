"""Moving captured tensors to another device without stalling the model.

A GPU tensor copied to the host with ``non_blocking=True`` must land in pinned memory to be truly
asynchronous, and must not be read before the copy finished. :func:`move` starts such a copy and
returns a :class:`Pending` that waits (on a CUDA event, not the whole device) only when read.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Pending", "device_arg", "move", "ready"]


class Pending:
    """A tensor whose device-to-host copy may still be running; :func:`ready` waits for it."""

    __slots__ = ("event", "tensor")

    def __init__(self, tensor: torch.Tensor, event: Any) -> None:
        self.tensor, self.event = tensor, event

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensor


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor | Pending:
    """Copy ``t`` to ``device``; asynchronous for CUDA -> CPU (pinned buffer + event)."""
    if t.device == device:
        return t
    if t.is_cuda and device.type == "cpu":
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        buf.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        return Pending(buf, event)
    return t.to(device, non_blocking=True)


def ready(value: Any) -> Any:
    """Resolve a value produced by :func:`move` (waits for a pending copy)."""
    return value.get() if isinstance(value, Pending) else value


def device_arg(to: Any, what: str) -> torch.device:
    """``to`` as a device this process can use, refused when the call is made (not at the first
    forward): an unknown name, a device type with no device here, an index past the last one."""
    if isinstance(to, bool) or not isinstance(to, (str, torch.device, int)):
        raise TypeError(
            f"{what} must be a device such as 'cpu' or 'cuda:0'; got {type(to).__name__}: {to!r}"
        )
    try:
        device = torch.device(to)
    except RuntimeError as e:
        raise ValueError(f"{what}={to!r} is not a device: {str(e).splitlines()[0]}") from None
    if device.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, device.type, None)
    count = (
        backend.device_count() if backend is not None and hasattr(backend, "device_count") else 0
    )
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    if not available or count == 0:
        raise ValueError(
            f"{what}={to!r}: this process has no {device.type} device; use 'cpu' (or None to keep "
            "tensors where the model computes them)"
        )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"{what}={to!r}: there are {count} {device.type} device(s), numbered 0 to {count - 1}"
        )
    return device
