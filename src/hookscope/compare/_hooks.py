"""The hooks that record one run, for :func:`hookscope.compare` (values kept in memory, spilled to
disk beyond ``max_bytes``) and :func:`hookscope.record` (values written to a folder as they come).

Per module call: its place in the call tree (parent, children, the order calls start and end), a
copy of its inputs when it starts (before the module can change them in place), a copy of its
output when it ends and, during backward, the gradient of each output leaf (what the callers send
back: the output is handed on as identity views, so a tensor the module also uses inside does not
count that use) and of each input leaf through this call only (the inputs are identity views for
the module). Values go to ``sink.put(key, value)``: ``in<k>``, ``out<k>``, ``grad<k>_<i>``,
``ingrad<k>_<i>`` for the call started ``k``-th and its ``i``-th tensor leaf (a tensor passed twice
gets its gradient on its first leaf).

Calls inside a reentrant activation checkpoint (their forward runs under ``no_grad``) get their
gradients from the recompute in backward, paired with the forward call by
:class:`~hookscope.core._recompute.Recomputes`; other recomputes are not recorded.

One pre-hook and one post-hook per module, each one pass over the call's tensors: the cost per
module call is what ``benchmarks/bench_compare.py`` measures (``hs.record`` against a plain step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..core._nested import iter_tensors, map_tensors
from ..core._recompute import Recomputes
from ..core._scope import HookScope, _Hook, acts_here, get_ident, graph_task_id, thread_checked

__all__ = ["CallHooks", "Entry"]


class Entry:
    """One module call as the hooks see it; ``n_in``/``n_out``: its input and output tensor
    leaves (their gradients are stored per leaf)."""

    __slots__ = (
        "alias",
        "children",
        "end",
        "in_dtypes",
        "index",
        "n_in",
        "n_out",
        "name",
        "parent",
    )

    def __init__(self, name: str, index: int, parent: int | None, alias: list[int] | None) -> None:
        self.name, self.index, self.parent, self.alias = name, index, parent, alias
        self.end = -1
        self.children: list[int] = []
        self.n_in = self.n_out = 0
        self.in_dtypes: list[torch.dtype] | None = None  # when the inputs are not kept

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "index": self.index, "parent": self.parent, "end": self.end,
                "children": self.children, "alias": self.alias, "n_in": self.n_in,
                "n_out": self.n_out}  # fmt: skip


class CallHooks:
    """Pre/post hooks on ``named`` modules (added to ``scope``) recording every call into ``sink``.

    ``copy(t)``: what is kept of an input or output tensor (a clone, or the tensor itself for a
    sink that writes it at once).
    ``root``: the model, whose calls are counted (``model_calls``) even when it is not hooked.
    ``inputs=False``: keep only the dtypes of each call's inputs (``Entry.in_dtypes``), neither
    their values nor their gradients (a live model compared with a recorded one needs no more).
    After the run: ``entries`` in start order, ``grads``: whether any gradient was recorded.
    """

    def __init__(
        self,
        named: dict[str, nn.Module],
        scope: HookScope,
        sink: Any,
        copy: Callable[[torch.Tensor], torch.Tensor],
        root: nn.Module | None = None,
        inputs: bool = True,
    ) -> None:
        self.scope, self.sink, self.copy = scope, sink, copy
        self.inputs = inputs
        self.entries: list[Entry] = []
        self.stack: list[int] = []
        self.counts: dict[str, int] = {}
        self.ended = 0
        self.model_calls = 0
        self.grads = False
        self.root = root
        # identity views to check for in-place changes, by the call whose end checks them
        self.watch: dict[int, list[tuple[torch.Tensor, int, str, str]]] = {}
        self.unchecked: list[tuple[torch.Tensor, int, str, str]] = []
        self.fired: set[str] = set()
        self.lost: dict[str, str] = {}  # key -> layer: gradients PyTorch never handed over
        self.recomputes = Recomputes()
        for name, m in named.items():
            scope.add_forward_pre(m, _Pre(self, name), layer=name, with_kwargs=True)
            scope.add_forward(m, _Post(self, name), layer=name, always_call=True)
        if root is not None and not any(m is root for m in named.values()):
            scope.add_forward_pre(root, _Count(self), layer="")

    # -- what the hooks do -----------------------------------------------------------------------
    def start(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if module is self.root:
            self.model_calls += 1
        i = self.counts.get(name, 0)
        self.counts[name] = i + 1
        pos = len(self.entries)
        parent = self.stack[-1] if self.stack else None
        leaves: list[torch.Tensor] = []
        copy = self.copy

        def keep(t: torch.Tensor) -> torch.Tensor:
            leaves.append(t)
            return copy(t)

        value = (tuple(args), dict(kwargs))
        if not self.inputs:
            leaves = [t for _, t in iter_tensors(value)]
            e = Entry(name, i, parent, None)
            e.n_in = len(leaves)
            e.in_dtypes = [t.dtype for t in leaves]
            self.entries.append(e)
            if parent is not None:
                self.entries[parent].children.append(pos)
            self.stack.append(pos)
            return None
        kept = map_tensors(keep, value)
        ids = [id(t) for t in leaves]
        alias = None
        if len(set(ids)) < len(ids):
            first: dict[int, int] = {}
            alias = [first.setdefault(k, j) for j, k in enumerate(ids)]
        e = Entry(name, i, parent, alias)
        e.n_in = len(leaves)
        self.entries.append(e)
        if parent is not None:
            self.entries[parent].children.append(pos)
        self.stack.append(pos)
        self.sink.put(f"in{pos}", kept)
        if not torch.is_grad_enabled():
            self.recomputes.note(name + "\0in", value, pos)
            return None
        if not any(t.requires_grad for t in leaves):
            return None
        return self._views(args, kwargs, f"ingrad{pos}_", name, check=pos)

    def end(self, name: str, output: Any) -> Any:
        if not self.stack:
            return None
        pos = self.stack.pop()
        self.checked(pos)  # its inputs, and its children's outputs: changed in place meanwhile?
        e = self.entries[pos]
        e.end = self.ended
        self.ended += 1
        if output.__class__ is torch.Tensor:
            e.n_out = 1
            self.sink.put(f"out{pos}", self.copy(output))
        else:
            n = [0]
            copy = self.copy

            def keep(t: torch.Tensor) -> torch.Tensor:
                n[0] += 1
                return copy(t)

            self.sink.put(f"out{pos}", map_tensors(keep, output))
            e.n_out = n[0]
        if output is None or not e.n_out:
            return None
        if not torch.is_grad_enabled():
            self.recomputes.note(name, output, pos)
            return None
        caller = self.stack[-1] if self.stack else None
        return self._views(output, None, f"grad{pos}_", name, check=caller)[0]

    def recompute(self, name: str, value: Any, pre: bool) -> Any:
        """In backward: a reentrant checkpoint's recompute of a call noted in its forward gets
        the gradient hooks (under the forward call's keys)."""
        if not self.recomputes.pending:
            return None
        pos = self.recomputes.claim(name + "\0in" if pre else name, value)
        if pos is None:
            return None
        if pre:
            return self._views(value[0], value[1], f"ingrad{pos}_", name)
        return self._views(value, None, f"grad{pos}_", name)[0]

    def _views(
        self, args: Any, kwargs: Any, key: str, layer: str, check: int | None = None
    ) -> tuple[Any, Any]:
        """Each tensor that requires grad replaced by its own identity view (the same tensor by
        the same view), a gradient hook on each view under ``key`` + its first leaf's index: the
        gradient through this use only.

        A view keeps the run exactly as without hookscope (an in-place op on it updates its
        base's history), but PyTorch drops a hook on a view that is changed in place: each view
        is checked when the call ``check`` ends (its own call for inputs, its caller for
        outputs), and a changed one's key goes to ``lost`` (its gradient is not recorded, and
        the comparison says so rather than reading a missing gradient as zero)."""
        views: dict[int, torch.Tensor] = {}
        n = [0]
        scope = self.scope
        watch = self.watch.setdefault(check, []) if check is not None else self.unchecked

        def alias(t: torch.Tensor) -> torch.Tensor:
            i = n[0]
            n[0] = i + 1
            if not t.requires_grad:
                return t
            v = views.get(id(t))
            if v is None:
                v = views[id(t)] = t.view_as(t)
                k = key + str(i)
                scope.add_activation_grad_hook(v, _LeafGrad(self, k), layer=layer)
                watch.append((v, v._version, k, layer))
            return v

        new_args = map_tensors(alias, args)
        return new_args, (map_tensors(alias, kwargs) if kwargs is not None else None)

    def checked(self, pos: int | None) -> None:
        """The views to check when call ``pos`` ends (``None``: the ones left, at the end)."""
        watch = self.watch.pop(pos, []) if pos is not None else self.unchecked
        for v, version, key, layer in watch:
            if v._version != version and key not in self.fired:
                self.lost[key] = layer
        if pos is None:
            self.unchecked = []
            for p in list(self.watch):
                self.checked(p)


class _Pre(_Hook):
    __slots__ = ("hooks", "name")

    def __init__(self, hooks: CallHooks, name: str) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks, self.name = hooks, name

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind):
            return None
        if graph_task_id() != -1:  # activation checkpointing re-running forward in backward
            return self.hooks.recompute(self.name, (args, kwargs), True)
        return self.hooks.start(self.name, module, args, kwargs)


class _Post(_Hook):
    __slots__ = ("hooks", "name")

    def __init__(self, hooks: CallHooks, name: str) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks, self.name = hooks, name

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind):
            return None
        if graph_task_id() != -1:
            return self.hooks.recompute(self.name, output, False)
        return self.hooks.end(self.name, output)


class _Count(_Hook):
    """On the model when it is not recorded itself: counts its forward calls."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: CallHooks) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks = hooks

    @thread_checked
    def __call__(self, module: nn.Module, args: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind):
            return
        if graph_task_id() == -1:
            self.hooks.model_calls += 1


class _LeafGrad:
    """The gradient of one tensor leaf, stored under its key (a scope's activation gradient hook:
    any thread, inert once the scope is removed)."""

    __slots__ = ("hooks", "key")

    def __init__(self, hooks: CallHooks, key: str) -> None:
        self.hooks, self.key = hooks, key

    def __call__(self, grad: torch.Tensor | None) -> None:
        hooks = self.hooks
        if grad is None or not hooks.scope.active:
            return
        hooks.grads = True
        hooks.fired.add(self.key)
        hooks.sink.put(self.key, grad.detach())  # autograd hands each hook a fresh tensor
