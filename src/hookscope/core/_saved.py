"""What autograd keeps for backward, per module: ``saved_tensors_hooks`` and a dispatch mode.

:class:`SavedTensors` is the engine under :func:`hookscope.memory_profile`, in core because any
product may want to know which layer saved what (it uses ``saved_tensors_hooks`` and a
``TorchDispatchMode``, both process-wide states that belong with the hook engine):

* every tensor autograd saves during the forward pass (the pack hook of
  :func:`torch.autograd.graph.saved_tensors_hooks`) is recorded as a :class:`SaveEvent`: its
  storage (a storage saved several times is one storage), its bytes, and the stack of module calls
  running when it was saved (forward pre-hooks push, ``always_call`` forward hooks pop, through a
  :class:`HookScope`);
* in a ``torch.compile``'d region only the region's root is hooked (a hook inside would break
  the compiled graph and change what it saves), so its saved tensors are the region's;
* the positional tensor inputs of every module call (what non-reentrant checkpointing of that
  module would keep: ``torch.utils.checkpoint`` saves them through the same hooks);
* optionally (``ops=True``) a dispatch mode that counts each module's forward FLOPs (the rules of
  :mod:`torch.utils.flop_counter`; one per output element for an op without a rule, none for a
  view) and the bytes
  of storages created during the step that are alive at once (forward and backward peaks), with a
  weak reference per new storage.

Parameters and buffers are told apart by storage. A pack hook returns the tensor itself: nothing
about the run changes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ._compiled import named_modules, region_of
from ._nested import iter_tensors
from ._scope import HookScope, graph_task_id

__all__ = ["CallInputs", "SaveEvent", "SavedTensors", "storage_key"]


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

    key: tuple[torch.device, int]
    nbytes: int
    stack: tuple[str, ...]  # module names, outermost first ('' is the root)
    param: bool  # the storage is a parameter's or a buffer's


@dataclass
class CallInputs:
    """The positional tensor inputs of one module call (storage keys and bytes)."""

    module: str
    stack: tuple[str, ...]
    inputs: list[tuple[tuple[torch.device, int], int]] = field(default_factory=list)


class SavedTensors:
    """Record saved tensors (and, with ``ops=True``, FLOPs and live bytes) of one forward+backward.

    Use as ``with SavedTensors(model) as rec: loss = ...; rec.forward_done(); loss.backward()``.
    """

    def __init__(self, model: nn.Module, *, ops: bool = False, backward_ops: bool = False) -> None:
        self.model = model
        self.events: list[SaveEvent] = []
        self.calls: list[CallInputs] = []
        self.call_counts: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.param_keys = {
            k[0]
            for t in [*model.parameters(), *model.buffers()]
            if (k := storage_key(t)) is not None
        }
        self.stack: list[str] = []
        self.scope = HookScope("memory_profile")
        self.ops = ops
        self.backward_ops = backward_ops  # keep the dispatch mode on in backward (peak there)
        self.peak_backward_measured = False
        self.live = 0
        self.peak_forward = 0
        self.peak_backward = 0
        self.live_end_forward = 0
        self.phase = "forward"
        self._seen: dict[tuple[torch.device, int], Any] = {}
        self._mode: Any = None
        self._hooks: Any = None

    # -- module stack -----------------------------------------------------------------------------
    def _attach(self) -> None:
        for name, module in named_modules(self.model):
            region = region_of(module)
            if region is not None and region.root is not module:
                continue  # inside a compiled region: a hook there would break its graph
            self.scope.add_forward_pre(module, self._pre(name), layer=name)
            self.scope.add_forward(module, self._post(name), layer=name, always_call=True)

    def _pre(self, name: str) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            if graph_task_id() != -1:  # a recompute (activation checkpointing) in backward
                return
            self.stack.append(name)
            self.call_counts[name] = self.call_counts.get(name, 0) + 1
            call = CallInputs(name, tuple(self.stack))
            for _, t in iter_tensors(args):
                k = storage_key(t)
                if k is not None and k[0] not in self.param_keys:
                    call.inputs.append(k)
            self.calls.append(call)

        return pre

    def _post(self, name: str) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if graph_task_id() != -1:
                return
            if self.stack and self.stack[-1] == name:
                self.stack.pop()

        return post

    # -- saved tensors ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if graph_task_id() == -1:
            k = storage_key(t)
            if k is not None:
                self.events.append(
                    SaveEvent(k[0], k[1], tuple(self.stack), k[0] in self.param_keys)
                )
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # -- lifecycle --------------------------------------------------------------------------------
    def forward_done(self) -> None:
        """Mark the end of the forward pass (the loss is computed); backward follows. Without
        ``backward_ops`` the dispatch mode ends here (it costs a Python call per operation)."""
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
            self.scope.remove()
            for ref in self._seen.values():
                ref.detach()
            self._seen.clear()

    # -- live bytes (dispatch mode) ---------------------------------------------------------------
    def _new_storages(self, out: Any) -> None:
        seen = self._seen
        for t in [out] if out.__class__ is torch.Tensor else [t for _, t in iter_tensors(out)]:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            key = (t.device, st.data_ptr())
            if key in seen or key in self.param_keys:
                continue
            n = st.nbytes()
            if n == 0:
                continue
            seen[key] = weakref.finalize(st, self._free, key, n)
            self.live += n
            if self.phase == "forward":
                if self.live > self.peak_forward:
                    self.peak_forward = self.live
            elif self.live > self.peak_backward:
                self.peak_backward = self.live

    def _free(self, key: tuple[torch.device, int], n: int) -> None:
        if self._seen.pop(key, None) is not None:
            self.live -= n

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if self.phase != "forward" or not self.stack:
            return
        packet = func._overloadpacket
        fast = _MATMUL.get(packet.__name__)
        if fast is not None:  # the common matmuls without the rules' tree walks (same counts)
            a, b = args[fast], args[fast + 1]
            n = 2 * a.numel() * b.shape[-1]
            self.flops[self.stack[-1]] = self.flops.get(self.stack[-1], 0) + n
            return
        rule = _flop_rules().get(packet)
        if rule is not None:
            try:
                n = int(rule(*args, **kwargs, out_val=out))
            except Exception:
                n = 0
        elif getattr(func, "is_view", False) or packet.__name__ in _NO_COMPUTE:
            n = 0  # a view computes nothing
        elif out.__class__ is torch.Tensor:
            n = out.numel()  # one per output element for an op without a FLOP rule
        else:
            n = sum(t.numel() for _, t in iter_tensors(out))
        name = self.stack[-1]
        self.flops[name] = self.flops.get(name, 0) + n


# matmul-like ops: index of the first matrix argument; FLOPs = 2 * numel(a) * columns(b)
# (a: (..., m, k), b: (..., k, n)), what torch.utils.flop_counter counts for them
_MATMUL = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}
# views that the dispatcher does not mark as such
_NO_COMPUTE = {"_unsafe_view", "alias", "detach", "lift_fresh"}
_rules: list[dict[Any, Any]] = []


def _flop_rules() -> dict[Any, Any]:
    if not _rules:
        from torch.utils.flop_counter import flop_registry

        _rules.append(flop_registry)
    return _rules[0]


def _make_mode(rec: SavedTensors) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            rec._new_storages(out)
            if rec.phase == "forward":
                rec._count(func, args, kwargs, out)
            return out

    return _Watch()
