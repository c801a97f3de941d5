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

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..core._nested import map_tensors, object_copier, tensors_of
from ..core._recompute import Recomputes
from ..core._scope import (
    HookScope,
    _Hook,
    acts_here,
    get_ident,
    graph_task_id,
    identity_views,
    quiet,
    thread_checked,
)

__all__ = ["CallHooks", "Entry"]


class Entry:
    """One module call as the hooks see it; ``n_in``/``n_out``: its input and output tensor
    leaves (their gradients are stored per leaf)."""

    __slots__ = (
        "alias",
        "children",
        "end",
        "in_dtypes",
        "in_shapes",
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
        self.in_shapes: list[tuple[int, ...]] | None = None  # and their shapes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "index": self.index, "parent": self.parent, "end": self.end,
                "children": self.children, "alias": self.alias, "n_in": self.n_in,
                "n_out": self.n_out}  # fmt: skip


class CallHooks:
    """Pre/post hooks on ``named`` modules (added to ``scope``) recording every call into ``sink``.

    ``copy(t)``: what is kept of an input or output tensor (a clone, or the tensor itself for a
    sink that writes it at once). ``share=True`` (a cloning ``copy``): a tensor kept again
    unchanged (the same object, or the identity view these hooks handed on, at the same
    ``_version``: a call's output passed to the next call, one input passed to three projections)
    gets the same copy, so it is cloned and held once.
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
        share: bool = False,
    ) -> None:
        self.scope, self.sink = scope, sink
        # id(tensor) -> (weak reference to it, its _version when copied, the copy)
        self.copies: dict[int, tuple[Any, int, torch.Tensor]] = {}
        self.copy = self._shared(copy) if share else copy
        self.objects = share  # a sink that keeps values (not one writing them at once)
        self.inputs = inputs
        self.entries: list[Entry] = []
        self.stack: list[int] = []
        self.counts: dict[str, int] = {}
        self.ended = 0
        self.model_calls = 0
        self.grads = False
        self.root = root
        # identity views to check for in-place changes, by the call whose end checks them
        # (view, its _version, key, layer, the tensor it views, the node of that tensor's base
        # then): see _views and checked
        self.watch: dict[int, list[tuple[torch.Tensor, int, str, str, torch.Tensor, Any]]] = {}
        self.unchecked: list[tuple[torch.Tensor, int, str, str, torch.Tensor, Any]] = []
        self.fired: set[str] = set()
        # keys whose gradient is taken from the graph's own nodes instead of a view changed in
        # place (see _recover): the view's hook, were it to fire, is ignored
        self.recovered: set[str] = set()
        # views checked unchanged when their call ended, checked again when the model's call
        # ends: a later change in place of the tensor they view (``out += x`` in a caller)
        # drops their hooks too
        # drops their hooks too (weak references: a tensor freed meanwhile was not changed, and
        # the record must not keep activations alive that the run would have freed)
        self.seen: list[tuple[Any, int, str, str, Any, Any]] = []
        self.lost: dict[str, str] = {}  # key -> layer: gradients PyTorch never handed over
        # module -> thread: calls made by another thread while a call of this one ran (a worker
        # the model started: hooks act on their own thread, so those calls are not recorded)
        self.elsewhere: dict[str, str] = {}
        # inputs=False: each call's inputs that require grad, their versions and nodes, to find
        # a call that works in place on its input (its output gradient taken as A's is)
        self.in_watch: dict[int, list[tuple[torch.Tensor, int, Any]]] = {}
        self.recomputes = Recomputes()
        # set by hs.record: the autograd node of each value a call handed on -> the call's
        # position (see _record._Outside)
        self.nodes: dict[Any, int] | None = None
        # a call is what ``module(...)`` does, its own hooks included: its inputs are what the
        # caller handed (before the module's pre-hooks), its output what the caller gets (after
        # its forward hooks), so a hook that changes them counts as the module's own computation
        try:
            scope.add_forward_many(
                [(m, _Pre(self, name), name) for name, m in named.items()],
                pre=True,
                with_kwargs=True,
                prepend=True,
            )
            scope.add_forward_many(
                [(m, _Post(self, name), name) for name, m in named.items()], always_call=True
            )
            if root is not None and not any(m is root for m in named.values()):
                scope.add_forward_pre(root, _Count(self), layer="")
        except BaseException:  # (a module refused) no hook left behind
            scope.remove()
            raise

    def _shared(
        self, copy: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        copies = self.copies
        ref = weakref.ref

        def shared(t: torch.Tensor) -> torch.Tensor:
            if t.is_inference():  # no version counter: always a copy of its own
                return copy(t)
            got = copies.get(id(t))
            if got is not None and got[0]() is t and got[1] == t._version:
                return got[2]
            c = copy(t)
            copies[id(t)] = (ref(t), t._version, c)
            return c

        return shared

    def _same_copy(self, t: torch.Tensor, v: torch.Tensor) -> None:
        """``v`` (an identity view of ``t``, sharing its version counter) has ``t``'s copy."""
        got = self.copies.get(id(t))
        if got is not None and got[0]() is t and not t.is_inference():
            self.copies[id(v)] = (weakref.ref(v), got[1], got[2])

    # -- what the hooks do -----------------------------------------------------------------------
    def start(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if module is self.root:
            self.model_calls += 1
        i = self.counts.get(name, 0)
        self.counts[name] = i + 1
        pos = len(self.entries)
        stack = self.stack
        parent = stack[-1] if stack else None
        if (
            not kwargs
            and args.__class__ is tuple
            and len(args) == 1
            and args[0].__class__ is torch.Tensor
        ):
            leaves = [args[0]]  # most calls: one tensor in (no walk, no aliases)
        else:
            leaves = tensors_of((args, kwargs))
        alias = None
        if self.inputs and len(leaves) > 1:
            ids = [id(t) for t in leaves]
            if len(set(ids)) < len(ids):
                first: dict[int, int] = {}
                alias = [first.setdefault(k, j) for j, k in enumerate(ids)]
        e = Entry(name, i, parent, alias)
        e.n_in = len(leaves)
        self.entries.append(e)
        if parent is not None:
            self.entries[parent].children.append(pos)
        stack.append(pos)
        if not self.inputs:
            e.in_dtypes = [t.dtype for t in leaves]
            e.in_shapes = [t.shape for t in leaves]
            if torch.is_grad_enabled():
                w = [(t, t._version, _node(t)) for t in leaves if t.requires_grad]
                if w:
                    self.in_watch[pos] = w
                    # the same identity views as a run that keeps its inputs (A's, a record's),
                    # without their gradient hooks: a view adds up the call's own uses of a
                    # tensor before the tensor's other uses, so the gradients of both runs are
                    # summed in the same order (an exact copy differs by exactly 0, not by the
                    # last bits of a residual stream's gradient)
                    return identity_views(args, kwargs)
            return None
        if len(leaves) == 1 and not kwargs and args.__class__ is tuple and len(args) == 1:
            kept = ((self.copy(leaves[0]),), {})
        elif self.objects:
            # kept in memory: the objects among the inputs (a cache) as they are now
            kept = map_tensors(self.copy, (tuple(args), dict(kwargs)), object_copier(where=name))
        else:
            kept = map_tensors(self.copy, (tuple(args), dict(kwargs)))
        self.sink.put(f"in{pos}", kept)
        if not torch.is_grad_enabled():
            self.recomputes.note(name + "\0in", (tuple(args), dict(kwargs)), pos)
            return None
        for t in leaves:
            if t.requires_grad:
                return self._views(args, kwargs, f"ingrad{pos}_", name, check=pos)
        return None

    def end(self, name: str, output: Any) -> Any:
        if not self.stack:
            return None
        pos = self.stack.pop()
        self.checked(pos, output)  # its inputs, its children's outputs: changed in place?
        w = self.in_watch.pop(pos, None) if self.in_watch else None
        if w is not None and output.__class__ is torch.Tensor:
            for t, version, node in w:
                if t._version != version and self._in_place_node(t, node, output, pos, None):
                    break
        if not self.stack and self.seen:  # the outermost call: changed since their check?
            seen, self.seen = self.seen, []
            for base_ref, version, key, layer, is_view, node in seen:
                base = base_ref()
                if (
                    base is not None
                    and base._version != version
                    and key not in self.fired
                    and key not in self.recovered
                ):
                    if key.startswith("grad") and not is_view and node is not None:
                        # a call's own output (the base itself): its node's gradient
                        self.scope.add_node_hook(
                            node, _NodeGrad(self, key, base.output_nr), pre=True
                        )
                        self.recovered.add(key)
                    else:
                        self.lost[key] = layer
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

            # kept in memory: the objects among the output (a ``Box(h)``, a cache) copied as
            # they are now, as the inputs' are (a caller changing them after the call, e.g.
            # ``box.h = ...``, changed the recorded output)
            other = object_copier(copy, where=name) if self.objects else None
            self.sink.put(f"out{pos}", map_tensors(keep, output, other))
            e.n_out = n[0]
        if output is None or not e.n_out:
            return None
        if not torch.is_grad_enabled():
            self.recomputes.note(name, output, pos)
            return None
        caller = self.stack[-1] if self.stack else None
        handed = self._views(output, None, f"grad{pos}_", name, check=caller)[0]
        if self.nodes is not None:
            for t in (handed,) if handed.__class__ is torch.Tensor else tensors_of(handed):
                node = t.grad_fn
                if node is not None:
                    self.nodes[node] = pos
        return handed

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
        the comparison says so rather than reading a missing gradient as zero) unless it can
        be taken from the graph's own nodes instead (:meth:`_recover`)."""
        watch = self.watch.setdefault(check, []) if check is not None else self.unchecked
        if kwargs is None and args.__class__ is torch.Tensor:  # one tensor: no walk
            if not args.requires_grad:
                return args, None
            v = args.view_as(args)
            k = key + "0"
            self.scope.add_view_grad_hook(v, _LeafGrad(self, k))
            watch.append((v, v._version, k, layer, args, _node(args)))
            if self.copies:
                self._same_copy(args, v)
            return v, None
        if (
            kwargs is not None
            and not kwargs
            and args.__class__ is tuple
            and len(args) == 1
            and args[0].__class__ is torch.Tensor
        ):
            v, _ = self._views(args[0], None, key, layer, check)
            return (v,), kwargs
        views: dict[int, torch.Tensor] = {}
        n = [0]

        def alias(t: torch.Tensor) -> torch.Tensor:
            i = n[0]
            n[0] = i + 1
            if not t.requires_grad:
                return t
            v = views.get(id(t))
            if v is None:
                v = views[id(t)] = t.view_as(t)
                k = key + str(i)
                self.scope.add_view_grad_hook(v, _LeafGrad(self, k))
                watch.append((v, v._version, k, layer, t, _node(t)))
                if self.copies:
                    self._same_copy(t, v)
            return v

        new_args = map_tensors(alias, args)
        return new_args, (map_tensors(alias, kwargs) if kwargs is not None else None)

    def checked(self, pos: int | None, output: Any = None) -> None:
        """The views to check when call ``pos`` ends (``None``: the ones left, at the end);
        ``output``: what call ``pos`` returned."""
        watch = self.watch.pop(pos, []) if pos is not None else self.unchecked
        for v, version, key, layer, t, node in watch:
            if v._version == version or key in self.fired or key in self.recovered:
                if pos is not None:
                    # the base, alive while any view of it is (a view object may die while its
                    # node lives on in the graph); the version counter is the base's
                    base = t._base if t._base is not None else t
                    self.seen.append((weakref.ref(base), version, key, layer, t._is_view(), node))
            elif pos is None or not self._recover(key, t, node, pos, output):
                self.lost[key] = layer
        if pos is None:
            self.unchecked = []
            for p in list(self.watch):
                self.checked(p)

    def _recover(self, key: str, t: torch.Tensor, node: Any, pos: int, output: Any) -> bool:
        """The gradient under ``key`` of the view of ``t`` made for it, changed in place, from
        the graph itself (in forward, when the change is found at the end of call ``pos``, which
        returned ``output``: the nodes are known before backward runs).

        PyTorch moves a view changed in place onto new history (its base's ``CopySlices``) and
        drops the hook of its old node. ``node`` is the node of ``t``'s base when the view was
        made.

        - A call's **output** ``t`` made by the call (not a view, not a leaf): its gradient,
          over every use, is what reaches ``node``, the node that made it (a pre-hook there).
        - A call's **input** that the call changed in place and returned
          (``nn.ReLU(inplace=True)``), viewing the whole of its base: the call's first in-place
          node on that base after ``node`` maps the gradient of the changed value (over every
          use: the returned tensor, or the caller's own reference to it) to the gradient of the
          input: a hook there gives both, the call's input gradient and its output gradient
          (replacing the returned view's, which sees only the uses of the returned tensor).

        Else (a view of part of a tensor, a leaf, an input changed in place but another tensor
        returned): ``False``, the key is lost."""
        if node is None:
            return False
        if key.startswith("grad"):
            if t._is_view():
                return False
            self.scope.add_node_hook(node, _NodeGrad(self, key, t.output_nr), pre=True)
            self.recovered.add(key)
            return True
        return self._in_place_node(t, node, output, pos, key)

    def _in_place_node(
        self, t: torch.Tensor, node: Any, output: Any, pos: int, key: str | None
    ) -> bool:
        """Call ``pos`` changed its input ``t`` in place and returned it (viewing the whole of its
        base; ``node``: the base's node when the call started): a hook on the call's first
        in-place node gives its input gradient (under ``key``, unless ``None``) and its output
        gradient, the changed value's over every use (see :meth:`_recover`)."""
        base = t._base if t._is_view() else t
        if (
            output.__class__ is not torch.Tensor
            or (output._base if output._is_view() else output) is not base
            or any(
                x.shape != base.shape
                or x.stride() != base.stride()
                or x.storage_offset() != base.storage_offset()
                for x in (t, output)
            )
        ):
            return False
        at, depth = base.grad_fn, 0
        while at is not None and at is not node and depth < 64:
            nxt = at.next_functions[0][0] if at.next_functions else None
            if nxt is node:
                out_key = f"grad{pos}_0"
                self.scope.add_node_hook(at, _NodeGradIn(self, key, out_key), pre=False)
                self.recovered.update(k for k in (key, out_key) if k is not None)
                return True
            at, depth = nxt, depth + 1
        return False


def _node(t: torch.Tensor) -> Any:
    """The node of ``t``'s base now (``None`` for a leaf)."""
    base = t._base
    return (base if base is not None else t).grad_fn


class _Pre(_Hook):
    __slots__ = ("hooks", "name")

    def __init__(self, hooks: CallHooks, name: str) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks, self.name = hooks, name

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            hooks = self.hooks
            if hooks.stack and self.name not in hooks.elsewhere:
                hooks.elsewhere[self.name] = threading.current_thread().name
            return None
        if quiet(self.scope_id):  # a product's own run of the model
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
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return None
        if quiet(self.scope_id):  # a product's own run of the model
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
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        if graph_task_id() == -1:
            self.hooks.model_calls += 1


class _LeafGrad:
    """The gradient of one tensor leaf, stored under its key: a gradient hook on the identity
    view, registered directly (no handle kept: it lives as long as the graph), acting in any
    thread, inert once the scope is removed, skipping ``None`` (a compiled graph calls the hooks
    of an output that got no gradient with ``None``)."""

    __slots__ = ("hooks", "key")

    def __init__(self, hooks: CallHooks, key: str) -> None:
        self.hooks, self.key = hooks, key

    def __call__(self, grad: torch.Tensor | None) -> None:
        hooks = self.hooks
        if grad is None or not hooks.scope.active or self.key in hooks.recovered:
            return
        hooks.grads = True
        hooks.fired.add(self.key)
        hooks.sink.put(self.key, grad.detach())  # autograd hands each hook a fresh tensor


class _NodeGrad:
    """A pre-hook of the node that made a call's output (see :meth:`CallHooks._recover`): the
    gradient reaching that output, stored under its key."""

    __slots__ = ("hooks", "key", "nr")

    def __init__(self, hooks: CallHooks, key: str, nr: int) -> None:
        self.hooks, self.key, self.nr = hooks, key, nr

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        hooks = self.hooks
        g = grads[self.nr] if self.nr < len(grads) else None
        if g is None or not hooks.scope.active:
            return
        hooks.grads = True
        hooks.fired.add(self.key)
        hooks.sink.put(self.key, g.detach().clone())


class _NodeGradIn:
    """A hook of a call's first in-place node on its input (see :meth:`CallHooks._recover`):
    the gradient it hands the input's earlier node (the input's, under ``key``) and the one it
    got (the changed value's: the call's output gradient, under ``out_key``)."""

    __slots__ = ("hooks", "key", "out_key")

    def __init__(self, hooks: CallHooks, key: str | None, out_key: str) -> None:
        self.hooks, self.key, self.out_key = hooks, key, out_key

    def __call__(self, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        hooks = self.hooks
        if not hooks.scope.active:
            return
        for k, got in ((self.out_key, grad_outputs), (self.key, grad_inputs)):
            g = got[0] if got else None
            if g is not None and k is not None:
                hooks.grads = True
                hooks.fired.add(k)
                hooks.sink.put(k, g.detach().clone())
