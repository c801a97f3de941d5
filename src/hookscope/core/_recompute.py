"""Reentrant activation checkpointing: gradients exist only in the recompute (docs/pitfalls.md §27).

``torch.utils.checkpoint(..., use_reentrant=True)`` runs the checkpointed forward under
``no_grad`` and runs it again in backward, with grad enabled; backward flows through the
*recomputed* tensors. A hook that records gradients (a tensor hook on the layer's output) has
nothing to hook on in the first forward, and must hook on the recompute while counting the call
once, as the first forward's. :class:`Recomputes` pairs them: a forward call inside a reentrant
checkpoint is :meth:`~Recomputes.note`\\ d with a fingerprint of its output (a sum on the device,
no host sync), and the recompute of that layer in backward :meth:`~Recomputes.claim`\\ s the call
whose fingerprint it matches (one host read per recomputed hooked call, only under reentrant
checkpointing). Non-reentrant checkpointing needs none of this: its first forward runs with grad,
and backward flows through the first forward's graph.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ._nested import iter_tensors

__all__ = ["REENTRANT_HINT", "Recomputes", "in_reentrant_checkpoint"]

REENTRANT_HINT = (
    "reentrant activation checkpointing (use_reentrant=True) ran this layer's forward under "
    "no_grad; its gradient comes from the recompute during backward: run backward first"
)

_codes: list[Any] = []


def in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside the first forward of a reentrant checkpoint (a walk up the
    Python stack for ``CheckpointFunction.forward``; call it only when grad is disabled)."""
    if not _codes:
        from torch.utils.checkpoint import CheckpointFunction

        _codes.append(CheckpointFunction.forward.__code__)
    code = _codes[0]
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _fingerprint(value: Any) -> tuple[tuple[int, ...], torch.Tensor] | None:
    t = next((t for _, t in iter_tensors(value) if t.is_floating_point()), None)
    if t is None:
        return None
    return tuple(t.shape), t.detach().float().sum()


class Recomputes:
    """Forward calls made inside reentrant checkpoints, waiting for their recompute in backward."""

    def __init__(self) -> None:
        self.pending: dict[str, list[tuple[tuple[tuple[int, ...], torch.Tensor], Any]]] = {}

    def note(self, layer: str, value: Any, payload: Any) -> bool:
        """In the no-grad first forward: remember ``payload`` (e.g. the call record) for ``layer``
        if this runs inside a reentrant checkpoint. Returns whether it was noted."""
        if torch.is_grad_enabled() or not in_reentrant_checkpoint():
            return False
        fp = _fingerprint(value)
        if fp is None:
            return False
        self.pending.setdefault(layer, []).append((fp, payload))
        return True

    def claim(self, layer: str, value: Any) -> Any:
        """In backward's recompute: the payload noted for the forward call whose output equals
        ``value`` (``None`` when this is no recompute of a noted call)."""
        waiting = self.pending.get(layer)
        if not waiting or not torch.is_grad_enabled():
            return None
        fp = _fingerprint(value)
        if fp is None:
            return None
        for i, (want, payload) in enumerate(waiting):
            if want[0] == fp[0] and bool(torch.equal(want[1], fp[1])):
                del waiting[i]
                if not waiting:  # nothing left: later recomputes skip the fingerprint
                    del self.pending[layer]
                return payload
        return None

    def clear(self) -> None:
        self.pending.clear()
