"""Counting FLOPs and live activation memory at the dispatcher, attributed to the running layer.

:class:`OpCounter` is a ``TorchDispatchMode`` that sees every ATen operator of a forward pass.
It counts FLOPs with the formulas of :class:`torch.utils.flop_counter.FlopCounterMode` (same
registry, same "decompose when no formula" rule), so its total equals FlopCounterMode's, and adds
each count to ``counter.sink.flops``: the summary keeps ``sink`` pointing at the innermost module
call on its hook stack. ``FlopCounterMode``'s own module tracking is not used (it adds global
module hooks and autograd hooks of its own).

It also tracks the bytes of tensor storages created by the forward and still alive, and their
peak: the CPU measure of the forward's peak memory (parameters, buffers and inputs excluded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EXTRA_FLOP_FORMULAS", "OpCounter", "flop_registry", "warm_up"]

aten = torch.ops.aten


def _sdpa_cpu_flop(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return int(flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape))


EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
"""Formulas hookscope adds to FlopCounterMode's, keyed by op packet, taking shapes.

``FlopCounterMode`` has no formula for the CPU flash-attention kernel that
``F.scaled_dot_product_attention`` runs on CPU (torch 2.1-2.15), so attention matmuls count 0 there.
hookscope counts them with FlopCounterMode's own SDPA formula. To reproduce hookscope's totals:
``FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)``.
"""
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    EXTRA_FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop


def flop_registry() -> dict[Any, Any]:
    """FlopCounterMode's formula registry plus :data:`EXTRA_FLOP_FORMULAS` (values take tensors)."""
    reg = dict(flop_counter.FlopCounterMode(display=False).flop_registry)
    for k, v in EXTRA_FLOP_FORMULAS.items():
        reg.setdefault(k, flop_counter.shape_wrapper(v))
    return reg


# op -> "decompose it to count FLOPs?". Shared by all counters: a decomposition that ran no counted
# operator once never does (batch_norm's Python decomposition is slow, so it is skipped afterwards).
_COMPOSITE: dict[Any, bool] = {}


class _Sink:
    __slots__ = ("flops",)

    def __init__(self) -> None:
        self.flops = 0


class OpCounter(TorchDispatchMode):
    """Counts FLOPs into ``self.sink.flops`` and tracks live/peak bytes of new storages.

    ``known`` are tensors whose storages are not counted (parameters, buffers, inputs): a view of
    one is not an allocation.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.registry = flop_registry()
        # formulas wrapped by shape_wrapper: called on shapes directly (pytree costs ~30 us a call)
        self._raw = {
            k: v.__wrapped__
            for k, v in self.registry.items()
            if getattr(v, "__code__", None) is _SHAPE_CODE and hasattr(v, "__wrapped__")
        }
        self.sink: Any = _Sink()
        self.total_flops = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._known: set[int] = set()
        self._keep_known: list[Any] = []  # strong refs so known keys stay valid during the run
        self._composite = _COMPOSITE
        self._inside = 0  # > 0 while running a decomposition
        for t in known:
            st = _storage(t)
            if st is not None:
                self._known.add(st._cdata)
                self._keep_known.append(st)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        formula = self.registry.get(packet)
        if formula is None and self._has_composite(func):
            # Same rule as FlopCounterMode: count what it decomposes into. A decomposition that
            # ran no counted operator is remembered and skipped afterwards (batch_norm's is slow).
            # Memory: only the op's outputs are tracked, as for an op that runs natively, so the
            # peak does not depend on whether this op was decomposed.
            before = self.total_flops
            self._inside += 1
            try:
                with self:
                    r = func.decompose(*args, **kwargs)
            finally:
                self._inside -= 1
            if r is not NotImplemented:
                if self.total_flops == before:
                    self._composite[func] = False
                if not self._inside:
                    self._track(r)
                return r
        out = func(*args, **kwargs)
        if formula is not None:
            raw = self._raw.get(packet)
            if raw is not None:  # what shape_wrapper does, without pytree's cost
                n = int(
                    raw(
                        *map(_shape_of, args),
                        out_shape=_shape_of(out),
                        **{k: _shape_of(v) for k, v in kwargs.items()},
                    )
                )
            else:
                n = int(formula(*args, **kwargs, out_val=out))
            self.sink.flops += n
            self.total_flops += n
        if not self._inside:
            self._track(out)
        return out

    def _has_composite(self, func: Any) -> bool:
        hit = self._composite.get(func)
        if hit is None:
            hit = self._composite[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
            ) or torch._C.DispatchKey.CompositeImplicitAutograd in getattr(func, "py_kernels", {})
        return hit

    def _track(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._add(o)

    def _add(self, t: torch.Tensor) -> None:
        if t._base is not None:  # a view: no new memory
            return
        st = _storage(t)
        if st is None:
            return
        key = st._cdata
        live = self._live
        if key in self._known:
            return
        hit = live.get(key)
        if hit is not None:
            if not hit[0].expired():
                return
            self.live_bytes -= live.pop(key)[1]  # a freed storage's address, reused
        n = st.nbytes()
        if self.live_bytes + n > self.peak_bytes:
            # Could be a new peak: drop what was freed since the last look, so the peak is exact.
            # (Sweeping only here keeps the cost off most allocations.)
            for k in [k for k, (ref, _) in live.items() if ref.expired()]:
                self.live_bytes -= live.pop(k)[1]
        live[key] = (StorageWeakRef(st), n)
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes


_SHAPE_CODE = flop_counter.shape_wrapper(lambda: 0).__code__


def _shape_of(a: Any) -> Any:
    """Tensors (also inside lists, tuples, dicts) replaced by their shapes, like shape_wrapper."""
    if isinstance(a, torch.Tensor):
        return a.shape
    if isinstance(a, (list, tuple)) and a:
        vals = [_shape_of(x) for x in a]
        return type(a)(*vals) if hasattr(type(a), "_fields") else type(a)(vals)
    if isinstance(a, dict):
        return {k: _shape_of(v) for k, v in a.items()}
    return a


_warm = False


def warm_up() -> None:
    """Pay the one-time cost of the first dispatch mode in this process (torch imports its
    compiler machinery then, ~3 s) before anything is timed."""
    global _warm
    if not _warm:
        with OpCounter():
            torch.zeros(1).add(1)
        _warm = True


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta wrappers...
        return None
