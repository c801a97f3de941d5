"""What autograd keeps for backward, per module: ``saved_tensors_hooks`` and a dispatch mode.

:class:`SavedTensors` is the engine under :func:`hookscope.memory_profile` (its only client): it
uses ``saved_tensors_hooks`` and a ``TorchDispatchMode``, both process-wide states, and registers
its module hooks through core's :class:`~hookscope.core._scope.HookScope` like every product:

* every tensor autograd saves during the forward pass (the pack hook of
  :func:`torch.autograd.graph.saved_tensors_hooks`) is recorded as a :class:`SaveEvent`: its
  storage (a storage saved several times is one storage), its bytes, and the stack of module calls
  running when it was saved (forward pre-hooks push, ``always_call`` forward hooks pop, through a
  :class:`HookScope`);
* in a ``torch.compile``'d region only the region's root is hooked (a hook inside would break
  the compiled graph and change what it saves), so its saved tensors are the region's;
* storages are told apart by device, address and, with ``ops=True``, a number the dispatch mode
  gives each storage it sees created (an input freed during forward and its address reused by a
  later tensor are two storages);
* the tensor inputs of every module call, keyword ones and those inside tuples, lists and dicts
  included (what non-reentrant checkpointing of that module keeps: ``apply_checkpointing`` gives
  them all to ``torch.utils.checkpoint``, which saves them through the same hooks);
* optionally (``ops=True``) a dispatch mode that counts each module's forward FLOPs (the rules of
  :mod:`torch.utils.flop_counter`; one per output element for an op without a rule, none for a
  view) and the bytes
  of storages created during the step that are alive at once (forward and backward peaks), with a
  weak reference per new storage.

Parameters and buffers are told apart by storage. The pack hook returns a detached alias of the
tensor (the tensor itself would close a reference cycle through a saved output's node, keeping a
graph freed during forward alive): nothing about the run changes. With a pack hook in place
autograd no longer checks that a saved tensor is unchanged when backward uses it, so the pack hook
keeps the tensor's version with it and the unpack hook makes that check
(:class:`SavedTensorChangedError`, naming the layer that saved it and the one that wrote it). A save whose graph is freed
before the forward ends (a statistic computed with autograd on and kept as a number) is dropped at
:meth:`SavedTensors.forward_done`: nothing keeps it for backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import named_modules, region_of
from ..core._errors import HookscopeError
from ..core._nested import iter_tensors
from ..core._scope import (
    HookScope,
    _Hook,
    get_ident,
    graph_task_id,
    lost_layers,
    quiet,
    thread_checked,
)

__all__ = ["CallInputs", "SaveEvent", "SavedTensorChangedError", "SavedTensors", "storage_key"]


class SavedTensorChangedError(HookscopeError, RuntimeError):
    """A tensor autograd saved for backward was changed in place before backward used it: the
    error a plain training step raises (a ``RuntimeError``), which autograd no longer raises
    once a ``saved_tensors_hooks`` pack hook is in place."""


def _outside_regions(module: nn.Module) -> bool:
    """Whether ``module`` is hooked by the profile: not inside a compiled region (its root is)."""
    region = region_of(module)
    return region is None or region.root is module


def storage_key(t: torch.Tensor) -> tuple[tuple[torch.device, int], int] | None:
    """``((device, data pointer), bytes)`` of a tensor's storage; None without one (size 0, or a
    tensor subclass without storage)."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    n = st.nbytes()
    if n == 0:
        return None
    return (t.device, st.data_ptr()), n


@dataclass(frozen=True)
class SaveEvent:
    """One tensor saved for backward: its storage, the storage's bytes, the module calls running."""

    key: tuple[torch.device, int, int]  # device, data pointer, generation (see SavedTensors)
    nbytes: int
    stack: tuple[str, ...]  # module names, outermost first ('' is the root)
    param: bool  # the storage is a parameter's or a buffer's


@dataclass
class CallInputs:
    """The tensor inputs of one module call, keyword ones included (storage keys and bytes)."""

    module: str
    stack: tuple[str, ...]
    inputs: list[tuple[tuple[torch.device, int, int], int]] = field(default_factory=list)


class _Pre(_Hook):
    """Forward pre-hook: push the module on the stack and note its tensor inputs (keyword ones included). A call
    from another thread is only noted (:attr:`SavedTensors.elsewhere`): ``saved_tensors_hooks``
    and the dispatch mode are per thread, so nothing it saves or computes is seen."""

    __slots__ = ("name", "rec")

    def __init__(self, rec: SavedTensors, name: str) -> None:
        self.rec, self.name, self.fn = rec, name, None

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if graph_task_id() != -1:  # a recompute (activation checkpointing) in backward
            return
        if get_ident() != self.thread:  # a thread the forward started, DataParallel's replicas
            self.rec.elsewhere.setdefault(self.name, None)
        elif not quiet(self.scope_id):
            self.rec._enter_call(self.name, (args, kwargs) if kwargs else args)


class _Post(_Hook):
    """Forward hook (``always_call``): pop the module."""

    __slots__ = ("name", "stack", "starts")

    def __init__(self, rec: SavedTensors, name: str) -> None:
        self.stack, self.starts, self.name, self.fn = rec.stack, rec.starts, name, None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.stack
        if stack and stack[-1] == self.name and graph_task_id() == -1:
            stack.pop()
            self.starts.pop()


class SavedTensors:
    """Record saved tensors (and, with ``ops=True``, FLOPs and live bytes) of one forward+backward.

    Use as ``with SavedTensors(model) as rec: loss = ...; rec.forward_done(); loss.backward()``.
    """

    def __init__(self, model: nn.Module, *, ops: bool = False, backward_ops: bool = False) -> None:
        self.model = model
        self.events: list[SaveEvent] = []
        self._packed: list[Any] = []  # per event: a weak reference to what the pack hook returned
        self.calls: list[CallInputs] = []
        self.call_counts: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.buffer_keys = {k[0] for t in model.buffers() if (k := storage_key(t)) is not None}
        self.param_keys = self.buffer_keys | {
            k[0] for t in model.parameters() if (k := storage_key(t)) is not None
        }
        self.stack: list[str] = []
        self.starts: list[int] = []  # per stack entry: the generation of its first new storage
        # modules that checkpointing would make wrong (an input changed in place...): the reason
        self.unsafe: dict[str, str] = {}
        # storage (with generation) -> modules whose calls took it as an input
        self._takers: dict[tuple[torch.device, int, int], list[str]] = {}
        self.scope = HookScope("memory_profile")
        self.ops = ops
        self.backward_ops = backward_ops  # keep the dispatch mode on in backward (peak there)
        self.peak_backward_measured = False
        self.live = 0
        self.peak_forward = 0
        self.peak_backward = 0
        self.live_end_forward = 0
        self.phase = "forward"
        self._seen: dict[tuple[torch.device, int], Any] = {}  # storage -> weak reference
        self._refs: dict[Any, tuple[tuple[torch.device, int], int]] = {}  # reference -> storage
        # storage address -> generation of the storage now there (the dispatch mode numbers each
        # new storage): a transient input freed and its address reused is another storage
        self._gen: dict[tuple[torch.device, int], int] = {}
        self._next_gen = 1
        self._mode: Any = None
        self._hooks: Any = None
        self._known: set[str] = set()  # the model's modules when hooked (by name)
        self.lost: dict[str, str] = {}  # modules whose calls the hooks missed (see _lost)
        self.elsewhere: dict[str, None] = {}  # modules called from another thread (see _Pre)
        # storage -> the module call that last wrote it in place in forward (None: loss_fn) and
        # the storage's version before that write
        self.writers: dict[tuple[torch.device, int], tuple[str | None, int]] = {}

    # -- module stack -----------------------------------------------------------------------------
    def _attach(self) -> None:
        # (a module inside a compiled region is not hooked: a hook there would break its graph)
        hooks = [(m, name) for name, m in named_modules(self.model) if _outside_regions(m)]
        self.scope.add_forward_many(
            [(m, _Pre(self, n), n) for m, n in hooks], pre=True, with_kwargs=True
        )
        self.scope.add_forward_many([(m, _Post(self, n), n) for m, n in hooks], always_call=True)
        # where the hooks sit (weakly): a module the step replaces (or adds) runs unhooked; its
        # saves charged to its caller (see lost), checked once at the end, never in the hooks
        self.scope.track(self.model, {n: m for m, n in hooks})
        self._known = {n for n, _ in named_modules(self.model)}

    def _lost(self) -> dict[str, str]:
        """The modules whose calls the step's hooks did not see (core's :func:`lost_layers`: a
        module replaced or added during the step ran unhooked, hooks ``hs.remove_hooks`` took;
        one added inside a compiled region would not have been hooked). Asked once, when the
        step is over."""
        return lost_layers(self.scope, self._known, _outside_regions)

    def _enter_call(self, name: str, args: Any) -> None:
        self.stack.append(name)
        self.starts.append(self._next_gen)
        self.call_counts[name] = self.call_counts.get(name, 0) + 1
        call = CallInputs(name, tuple(self.stack))
        params, gen, inputs = self.param_keys, self._gen, call.inputs
        if args.__class__ is tuple and all(t.__class__ is torch.Tensor for t in args):
            tensors = args  # the common case, without walking nested containers
        else:
            tensors = [t for _, t in iter_tensors(args)]
        for t in tensors:
            k = storage_key(t)
            if k is not None and k[0] not in params:
                key = (*k[0], gen.get(k[0], 0))
                inputs.append((key, k[1]))
                self._takers.setdefault(key, []).append(name)
        self.calls.append(call)

    # -- in-place writes (dispatch mode) ----------------------------------------------------------
    def _written(self, t: torch.Tensor) -> None:
        """An operation of the forward wrote ``t`` in place. Every running module call that did
        not create its storage, and every finished call that took it as an input, would recompute
        from the changed value under checkpointing: they are marked unsafe. Buffers are left out
        (``apply_checkpointing`` replays them exactly)."""
        k = storage_key(t)
        if k is None:
            return
        unsafe, stack = self.unsafe, self.stack
        # who wrote it last, and its version before that write (the dispatcher bumps it after
        # this mode returns): named if a tensor saved for backward turns out changed (_unpack)
        self.writers[k[0]] = (stack[-1] if stack else None, t._version)
        if k[0] in self.buffer_keys:
            return
        if k[0] in self.param_keys:
            for name in stack:
                unsafe.setdefault(name, "changes a parameter in place in its forward")
            return
        gen = self._gen.get(k[0], 0)
        for name, start in zip(stack, self.starts):
            if gen < start:  # the storage is older than this call: an input, or outside state
                unsafe.setdefault(
                    name,
                    "changes in place a tensor it did not create (its input), so its "
                    "recompute would start from the changed value",
                )
        writer = stack[-1] if stack else ""
        for name in self._takers.get((*k[0], gen), ()):
            if name not in stack:
                unsafe.setdefault(
                    name,
                    f"its input is changed in place after its call (by {writer!r}), so "
                    "its recompute would start from the changed value",
                )

    # -- saved tensors ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int, str | None]:
        # a detached alias, as PyTorch's docs ask: ``t`` itself would close a reference cycle
        # (a saved output holds its node, which holds it), keeping a graph freed during forward
        # alive until Python's garbage collector runs: live bytes and peaks the plain step
        # does not have. With a pack hook in place autograd no longer checks the tensor's
        # version when backward unpacks it, so the version travels with it (see _unpack), and
        # the module whose operation saved it (to name it)
        packed = t.detach()
        stack = self.stack
        if graph_task_id() == -1:
            k = storage_key(t)
            if k is not None:
                key = (*k[0], self._gen.get(k[0], 0))
                self.events.append(SaveEvent(key, k[1], tuple(stack), k[0] in self.param_keys))
                # alive exactly as long as the graph node that saved it (see forward_done)
                self._packed.append(weakref.ref(packed))
        return packed, t._version, stack[-1] if stack else None

    def _unpack(self, packed: tuple[torch.Tensor, int, str | None]) -> torch.Tensor:
        """The saved tensor, after the check autograd makes without pack hooks: changed in place
        since it was saved, it would give gradients of the changed value, where a plain
        training step raises."""
        t, version, owner = packed
        if t._version != version:
            raise SavedTensorChangedError(self._changed_message(t, version, owner))
        return t

    def _changed_message(self, t: torch.Tensor, version: int, owner: str | None) -> str:
        where = "the loss (loss_fn)" if owner is None else f"layer {owner or '<root>'!r}"
        k = storage_key(t)
        wrote = self.writers.get(k[0]) if k is not None else None
        by = ""
        if wrote is not None and wrote[1] >= version:  # a forward write after the save
            by = " by the loss (loss_fn)" if wrote[0] is None else f" by {wrote[0] or '<root>'!r}"
        return (
            f"memory_profile: a tensor that {where} saved for backward ({t.dtype} "
            f"{list(t.shape)}) was changed in place after it was saved{by} (version {version}, "
            f"now {t._version}), so backward would compute gradients from the changed value; "
            'a plain training step raises here too ("one of the variables needed for gradient '
            'computation has been modified by an inplace operation"). Fix the model: use the '
            "out-of-place form of that operation (y = y + 1, not y.add_(1)) or change a clone "
            "(y = y.clone(), then y.add_(1))"
        )

    # -- lifecycle --------------------------------------------------------------------------------
    def forward_done(self) -> None:
        """Mark the end of the forward pass (the loss is computed); backward follows. Without
        ``backward_ops`` the dispatch mode ends here (it costs a Python call per operation)."""
        # what a graph freed during forward saved (a statistic computed with autograd on and
        # kept as a number) is not kept for backward: only the saves whose node is alive count
        packed, self._packed = self._packed, []
        self.events = [e for e, r in zip(self.events, packed) if r() is not None]
        self.live_end_forward = self.live
        self.phase = "backward"
        self.peak_backward = self.live
        if self._mode is not None and not self.backward_ops:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        else:
            self.peak_backward_measured = self._mode is not None

    def __enter__(self) -> SavedTensors:
        self._attach()
        try:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            if self.ops:
                self._mode = _make_mode(self)
                self._mode.__enter__()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
            if self._hooks is not None:
                hooks, self._hooks = self._hooks, None
                hooks.__exit__(None, None, None)
        finally:
            if self.scope.active and not any(exc):  # what the hooks missed (the step ran)
                self.lost = self._lost()
            self.scope.remove()
            self._seen.clear()  # the weak references die with them: no callback after this
            self._packed.clear()
            self._refs.clear()
            self._gen.clear()
            self.writers.clear()

    # -- live bytes (dispatch mode) ---------------------------------------------------------------
    def _new_storage(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if the step has not seen it yet; a weak reference takes it off
        when PyTorch frees it (the storage's Python object lives exactly as long as the storage)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = (t.device, st.data_ptr())
        if key in self._seen or key in self.param_keys:
            return
        n = st.nbytes()
        if n == 0:
            return
        ref = weakref.ref(st, self._free)
        self._seen[key] = ref
        self._refs[ref] = (key, n)
        self._gen[key] = self._next_gen
        self._next_gen += 1
        live = self.live = self.live + n
        if self.phase == "forward":
            if live > self.peak_forward:
                self.peak_forward = live
        elif live > self.peak_backward:
            self.peak_backward = live

    def _free(self, ref: Any) -> None:
        got = self._refs.pop(ref, None)
        if got is not None:
            key, n = got
            if self._seen.get(key) is ref:
                del self._seen[key]
            self.live -= n


# How the dispatch mode treats an operation, decided once per operation overload (``_kind``):
# ``(flops, data, new, writes)``: how to count its FLOPs, the matmul index or FLOP rule, whether
# its outputs may be new storages (not for a view, nor for an in-place op: it writes a storage
# that exists), and which arguments it writes in place
_NONE = 0  # a view (or an alias): no FLOPs
_NUMEL = 1  # no FLOP rule: one FLOP per output element
_RULE = 2  # a rule of torch.utils.flop_counter
_MM = 3  # a matmul: 2 * numel(a) * columns(b), what torch.utils.flop_counter counts for it
# matmul-like ops: index of the first matrix argument (a: (..., m, k), b: (..., k, n))
_MATMUL = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}
# views that the dispatcher does not mark as such
_NO_COMPUTE = {"_unsafe_view", "alias", "detach", "lift_fresh"}
# ``writes``: the arguments it writes in place (its schema's ``Tensor(a!)`` ones), as positions and
# keyword names, or None
_Writes = tuple[tuple[int, ...], tuple[str, ...]] | None
_kinds: dict[Any, tuple[int, Any, bool, _Writes]] = {}


def _written_args(func: Any) -> _Writes:
    schema = func._schema
    if not schema.is_mutable:
        return None
    where = [
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    return (tuple(i for i, _ in where), tuple(n for _, n in where)) if where else None


def _kind(func: Any) -> tuple[int, Any, bool, _Writes]:
    """``(flops, data, new, writes)`` of an operation overload (see above), decided once."""
    got = _kinds.get(func)
    if got is None:
        from torch.utils.flop_counter import flop_registry

        packet = func._overloadpacket
        name = packet.__name__
        view = bool(getattr(func, "is_view", False)) or name in _NO_COMPUTE
        inplace = not view and func._schema.is_mutable and name.endswith("_")
        writes = _written_args(func)
        if name in _MATMUL:
            got = (_MM, _MATMUL[name], True, writes)
        elif packet in flop_registry:
            got = (_RULE, flop_registry[packet], not inplace, writes)
        elif view:
            got = (_NONE, None, False, writes)
        else:
            got = (_NUMEL, None, not inplace, writes)
        _kinds[func] = got
    return got


_mode_class: list[type] = []


def _make_mode(rec: SavedTensors) -> Any:
    """The dispatch mode watching ``rec``'s step (its class is made once, on first use)."""
    if not _mode_class:
        from torch.utils._python_dispatch import TorchDispatchMode

        Tensor = torch.Tensor

        class _Watch(TorchDispatchMode):
            """One Python call per operation: the operation, its new storages, its FLOPs."""

            def __init__(self, rec: SavedTensors) -> None:
                super().__init__()
                self.rec, self.new_storage = rec, rec._new_storage
                self.flops, self.stack = rec.flops, rec.stack

            def wrote(self, writes: Any, args: Any, kwargs: Any) -> None:
                positions, names = writes
                for i, name in zip(positions, names):
                    t = args[i] if i < len(args) else (kwargs or {}).get(name)
                    for _, x in iter_tensors(t):
                        self.rec._written(x)

            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # no ``torch._disable_dynamo`` wrapper around every call: the mode never runs in
                # a compiled model (memory_profile turns it off there)
                return False

            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                out = func(*args, **kwargs) if kwargs else func(*args)
                kind, data, new, writes = _kinds.get(func) or _kind(func)
                if writes is not None and self.rec.phase == "forward":
                    self.wrote(writes, args, kwargs)
                single = out.__class__ is Tensor
                if new:
                    if single:
                        self.new_storage(out)
                    else:
                        for _, t in iter_tensors(out):
                            self.new_storage(t)
                stack = self.stack
                if kind == _NONE or not stack or self.rec.phase != "forward":
                    return out
                if kind == _MM:
                    n = 2 * args[data].numel() * args[data + 1].shape[-1]
                elif kind == _NUMEL:
                    n = out.numel() if single else sum(t.numel() for _, t in iter_tensors(out))
                else:
                    try:
                        n = int(data(*args, **(kwargs or {}), out_val=out))
                    except Exception:
                        n = 0
                flops, name = self.flops, stack[-1]
                flops[name] = flops.get(name, 0) + n
                return out

        _mode_class.append(_Watch)
    return _mode_class[0](rec)
