"""``DistributedDataParallel``: parameter gradient edits act on the averaged gradient (docs/pitfalls.md §18).

DDP averages gradients in its reducer: autograd accumulates this rank's gradient into ``.grad``,
a hook DDP placed on that accumulation copies it into a bucket, the buckets are all-reduced
(through the user's communication hook, if any) while the backward pass goes on, and a callback
DDP queues on autograd's engine when the last bucket is ready writes the averages back into
``.grad``. A tensor hook on the parameter sees the local gradient; the averaged one exists only
after DDP's callback. So hookscope edits it after that callback: at the end of the backward pass
(:class:`~._gradcheck.FireCheck` runs its end functions after every callback queued during the
backward, DDP's included), on ``.grad`` itself, as one process on the combined batch would.

No communication hook is involved: DDP allows one per model and never removes it, and the user
may have one (compression, PowerSGD); the edit acts on what the user's reduction produced.

Accumulation, as for a plain model and FSDP2: each backward pass's gradient is edited on its own
(the ``.grad`` of earlier passes is set aside when the backward starts and added back after the
edit). Under ``ddp.no_sync()`` DDP does not reduce: the micro-steps accumulate locally and the
next synchronizing backward averages their sum; the edit then applies once, to that averaged
sum (the step's gradient), which is what one process gets from one backward on the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ._compiled import named_modules
from ._errors import HookscopeError
from ._gradcheck import FireCheck
from ._scope import HookScope, in_backward

__all__ = ["DDPGradEditor", "ddp_of", "wrapping_ddp"]

# parameter -> [its .grad set aside at the start of the backward pass, editors still to finish]:
# shared by every editor (several scopes on one model), so that the edits chain as tensor hooks
# do and the earlier gradient is added back once, after the last edit
# (keyed by id: a tensor's == is elementwise; an entry lives from the start of a backward to its end)
_held: dict[int, list[Any]] = {}


def ddp_of(
    model: nn.Module, name: str, memo: dict[str, Any] | None = None
) -> tuple[str, nn.Module] | None:
    """``(prefix, ddp)``: the ``DistributedDataParallel`` in ``model`` that holds parameter
    ``name``, else the one wrapping ``model`` (prefix ``""``; see :func:`wrapping_ddp`, looked up
    once per ``memo``: one scope's parameters share it)."""
    ddp_cls = nn.parallel.DistributedDataParallel
    for prefix, module in named_modules(model):
        if isinstance(module, ddp_cls) and (not prefix or name.startswith(prefix + ".")):
            return prefix, module
    memo = {} if memo is None else memo
    if "wrapping_ddp" not in memo:
        memo["wrapping_ddp"] = wrapping_ddp(model)
    outer = memo["wrapping_ddp"]
    return None if outer is None else ("", outer)


def wrapping_ddp(module: nn.Module) -> nn.Module | None:
    """The ``DistributedDataParallel`` whose ``.module`` is ``module`` (the user passed
    ``ddp.module``, whose parameters DDP still averages), or None. Looked up only while a process
    group is initialized, through the garbage collector's referrers (the module holds no link to
    its wrapper): the wrapper's ``_modules`` dict, that dict's owner."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    import gc

    ddp_cls = nn.parallel.DistributedDataParallel
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict) or holder.get("module") is not module:
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, dict):  # a materialized instance __dict__: one more level up
                owners = [
                    o for o in gc.get_referrers(owner) if getattr(o, "__dict__", None) is owner
                ]
            else:
                owners = [owner]
            for o in owners:
                if isinstance(o, ddp_cls) and o.module is module:
                    return o
    return None


class DDPGradEditor:
    """Edits the averaged gradients of the parameters of one DDP module, for one scope."""

    def __init__(self, scope: HookScope, ddp: nn.Module, layer: str, check: FireCheck) -> None:
        self._scope, self._check = scope, check
        self._edits: dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], Any]]] = {}
        self._sync = True  # the last forward pass prepared DDP's reducer (not under no_sync())
        self._syncing = False  # ... the one whose backward is in progress
        self._unreduced = False  # .grad holds micro-steps accumulated under no_sync()
        self._started = False
        scope.add_forward(ddp, self._on_forward, layer=layer)
        scope.on_remove(self._abandon)
        check.at_start(self._start)
        check.at_end(self._end)

    def add(self, name: str, param: torch.Tensor, on_grad: Callable[[torch.Tensor], Any]) -> None:
        self._edits[name] = (param, on_grad)
        self._scope.add_post_accumulate_grad(param, self._accumulated(name), layer=name)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not in_backward():
            self._sync = bool(getattr(module, "require_backward_grad_sync", True))

    def _accumulated(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._check.fired(name)  # autograd computed it: the edit follows at the end
            if not self._started:
                raise HookscopeError(
                    f"{self._check.owner}: parameter {name!r} of a DistributedDataParallel model got a "
                    "gradient in a backward pass that did not start from the output of a forward pass "
                    "run while the scope was open, so its averaged gradient cannot be edited. Open "
                    "the scope before the forward pass, and run backward from the model's output"
                )

        return hook

    def _start(self) -> None:
        self._started, self._syncing = True, self._sync
        if not self._syncing or self._unreduced:
            return  # DDP will average what .grad holds (with this backward's gradient) at once
        for param, _ in self._edits.values():
            entry = _held.get(id(param))
            if entry is None:
                g = param.grad
                if g is not None and g._is_view():  # gradient_as_bucket_view: DDP reuses it
                    g = g.clone()
                _held[id(param)] = [g, 1]
                param.grad = None  # DDP writes this backward's averaged gradient alone
            else:
                entry[1] += 1

    def _abandon(self) -> None:
        """The scope is removed: a backward pass that never reached its end (it raised) leaves
        the .grad it set aside; put it back where nothing replaced it."""
        if not self._started:
            return
        self._started = False
        for param, _ in self._edits.values():
            entry = _held.pop(id(param), None)
            if entry is not None and entry[0] is not None and param.grad is None:
                param.grad = entry[0]

    def _end(self) -> None:
        if not self._started:
            return
        self._started = False
        if not self._syncing:
            self._unreduced = self._unreduced or any(
                p.grad is not None for p, _ in self._edits.values()
            )
            return
        unreduced, self._unreduced = self._unreduced, False
        for param, on_grad in self._edits.values():
            g = param.grad
            if g is not None and self._scope.active:
                new = on_grad(g)
                if new is not None and new is not g:
                    param.grad = g = new
            if unreduced:
                continue
            entry = _held.get(id(param))
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del _held[id(param)]
                prev = entry[0]
                if prev is not None:
                    if g is not None:
                        prev.add_(g)
                    param.grad = prev
