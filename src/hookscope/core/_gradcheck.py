"""Never silently nothing: check, at the end of each backward, that parameter gradient hooks fired.

A parameter's tensor hook fires only when autograd computes that parameter's gradient. A wrapper
that runs the forward on a copy of the parameter and writes ``.grad`` itself (FSDP1, some
offloading or quantisation wrappers) updates ``.grad`` while the hook never runs: an edit or a
clip would silently do nothing. :class:`FireCheck` notes each watched parameter's ``.grad``
(object and version) when the model runs forward, and at the end of the backward pass that
follows (a callback queued on autograd's engine from a hook on the model's output) raises
:class:`HookscopeError` for a parameter whose ``.grad`` changed while its hook did not fire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ._errors import HookscopeError
from ._nested import iter_tensors
from ._scope import HookScope, graph_task_id, in_backward

__all__ = ["FireCheck"]


def _stamp(p: torch.Tensor) -> tuple[int, int] | None:
    g = p.grad
    if g is None:
        return None
    t = g.to_local() if hasattr(g, "to_local") else g
    return id(g), t._version


class FireCheck:
    """Watches parameters whose gradient hooks a scope added; see the module docstring.

    ``fired(name)`` is called by the hook each time it runs. ``at_start(fn)`` / ``at_end(fn)``
    register ``fn()`` to run when a backward pass reaches the model's output (before any
    parameter gradient is computed) and at its end (before the check).
    """

    def __init__(self, scope: HookScope, model: nn.Module, owner: str) -> None:
        self.owner = owner
        self.params: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self._before: dict[str, tuple[tuple[int, int] | None, int]] = {}
        self._queued = -2
        self._starts: list[Callable[[], None]] = []
        self._ends: list[Callable[[], None]] = []
        self._scope = scope
        self.helpers: dict[str, Any] = {}  # per-scope state of the editors that use this check
        self.reported: set[str] = set()  # parameters this check raised about (already loud)
        scope.add_forward(model, self._on_forward, layer="")

    def watch(self, name: str, param: torch.Tensor) -> None:
        self.params[name] = param
        self.count[name] = 0

    def at_start(self, fn: Callable[[], None]) -> None:
        self._starts.append(fn)

    def at_end(self, fn: Callable[[], None]) -> None:
        self._ends.append(fn)

    def fired(self, name: str) -> None:
        self.count[name] += 1

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or in_backward():  # (checkpointing re-runs forward)
            return
        self._before = {n: (_stamp(p), self.count[n]) for n, p in self.params.items()}
        for _, t in iter_tensors(output):
            if t.requires_grad:
                self._scope.add_activation_grad_hook(t, self._on_output_grad, layer="")

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        task = graph_task_id()
        if task != self._queued:  # once per backward pass
            self._queued = task
            for fn in self._starts:
                fn()
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        # Run after every callback queued in this backward so far, e.g. FSDP2's final one, which
        # reduces the gradients of the root's own parameters (autograd runs callbacks queued by a
        # callback, in order).
        torch.autograd.Variable._execution_engine.queue_callback(self._check)

    def _check(self) -> None:
        for fn in self._ends:
            fn()
        if not self._scope.active:
            return
        missed = [
            n
            for n, p in self.params.items()
            if n in self._before
            and _stamp(p) not in (None, self._before[n][0])
            and self.count[n] == self._before[n][1]
        ]
        self._before = {}
        if missed:
            self.reported.update(missed)
            p = self.params[missed[0]]
            raise HookscopeError(
                f"{self.owner}: the gradient of parameter {missed[0]!r} ({type(p).__name__}) was "
                f"written to .grad in this backward, but hookscope's hook on it never ran, so the "
                f"edit was NOT applied (parameters affected: {missed}). Something computes this "
                "gradient outside autograd's view of the parameter (e.g. FSDP1, an offloading or "
                "quantisation wrapper). Use FSDP2 (fully_shard), or edit the gradient of the "
                "layer's output instead"
            )
