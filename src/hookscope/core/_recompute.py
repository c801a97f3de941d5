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

import itertools
import sys
import warnings
from typing import Any

import torch

from ._errors import HookscopeWarning, some_names
from ._nested import iter_tensors
from ._scope import HookScope, graph_task_id

__all__ = [
    "REENTRANT_HINT",
    "Recomputes",
    "Replays",
    "in_checkpoint_forward",
    "in_reentrant_checkpoint",
]

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


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def in_checkpoint_forward() -> bool:
    """Whether the caller runs inside the first forward of a non-reentrant checkpoint (its
    saved-tensor hooks are the innermost ones)."""
    if _top_hooks is None:
        return False
    try:
        hooks = _top_hooks(False)
    except Exception:
        return False
    return hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False))


_tokens = itertools.count()


class Replays:
    """Keeps a forward-editing scope (edit, steer) exact under activation checkpointing.

    A checkpointed region runs its forward again in backward (the recompute) and back-propagates
    through what the recompute computes, with the hooks on the modules *then*. So:

    * in a recompute, the scope acts only on a layer it acted on in a forward (:meth:`acts`):
      a scope opened around ``backward()`` only must not edit a forward that ran unedited;
    * a scope that acted on a call inside a checkpointed region and closes before that call's
      backward reached it warns at exit (the recompute would run unedited, giving the gradients
      of another forward): non-reentrant calls are tracked by a gradient hook on the edited
      output, reentrant ones (whose first forward runs under ``no_grad``) by their recompute.
    """

    __slots__ = ("acted", "owner", "reentrant", "scope", "waiting")

    def __init__(self, scope: HookScope, owner: str) -> None:
        self.scope, self.owner = scope, owner
        self.acted: dict[str, int] = {}  # forward calls acted on (outside backward), per layer
        self.reentrant: dict[str, int] = {}  # reentrant checkpointed calls not yet recomputed
        self.waiting: dict[int, str] = {}  # non-reentrant ones whose output got no gradient yet
        scope.on_remove(self._check)

    def acts(self, layer: str) -> bool:
        """Before acting on a call: False in a recompute of a layer this scope never acted on."""
        if graph_task_id() == -1:
            return True
        n = self.reentrant.get(layer, 0)
        if n:
            self.reentrant[layer] = n - 1
            return True
        return self.acted.get(layer, 0) > 0

    def acted_on(self, layer: str, module: torch.nn.Module, value: Any) -> None:
        """After acting on a call (``value``: what the layer now returns)."""
        if graph_task_id() != -1:
            return
        self.acted[layer] = self.acted.get(layer, 0) + 1
        if not torch.is_grad_enabled():
            # (a training module only: a stack walk per call would slow down generation)
            if module.training and in_reentrant_checkpoint():
                self.reentrant[layer] = self.reentrant.get(layer, 0) + 1
            return
        if not in_checkpoint_forward():
            return
        t = next((t for _, t in iter_tensors(value) if t.requires_grad), None)
        if t is None:
            return
        token = next(_tokens)
        self.waiting[token] = layer
        waiting = self.waiting

        def arrived(grad: torch.Tensor) -> None:
            waiting.pop(token, None)

        self.scope.add_activation_grad_hook(t, arrived, layer=layer)

    def _check(self) -> None:
        if self.scope.failed or sys.exc_info()[1] is not None:
            return
        names = sorted(set(self.waiting.values()) | {n for n, c in self.reentrant.items() if c})
        self.waiting.clear()
        self.reentrant.clear()
        if names:
            warnings.warn(
                f"{self.owner}: layer(s) {some_names(names)} were edited inside activation-"
                "checkpointed code (torch.utils.checkpoint, gradient_checkpointing_enable(), "
                "hs.apply_checkpointing) whose backward had not run when the scope closed: the "
                "recompute in backward runs without the scope, so the gradients would be those of "
                "an unedited forward (docs/pitfalls.md §27); call backward() inside the with block",
                HookscopeWarning,
                stacklevel=4,
            )
