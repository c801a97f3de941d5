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

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from ..core._buffers import SPARSE_PARTS
from ..core._inventory import module_hooks
from ..core._scope import _Hook

__all__ = [
    "EXTRA_FLOP_FORMULAS",
    "OpCounter",
    "data_bytes",
    "flop_registry",
    "native_rule",
    "no_dispatch",
    "warm_up",
]

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
        self.registry, self._raw = _registries()
        self.sink: Any = _Sink()
        self.total_flops = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._known: set[int] = set()
        self._keep_known: list[Any] = []  # strong refs so known keys stay valid during the run
        # layer (None: outside any call) -> the kind of a tensor it created whose bytes cannot
        # be read (an opaque layout), so the live bytes and the peak leave it out
        self.uncounted: dict[str | None, str] = {}
        self._composite = _COMPOSITE
        self._inside = 0  # > 0 while running a decomposition
        for t in known:
            for st in _storages(t) or ():
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
        if t.__class__ is torch.Tensor and not t.is_nested:  # the common case
            st = _storage(t)
            if st is not None:
                self._add_storage(st)
                return
        got = _storages(t)  # sparse, nested, a wrapper subclass: the tensors holding its data
        if got is None:
            if not isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # (no data yet)
                # bytes that cannot be read (an opaque layout): noted under the running layer,
                # said by the summary (the live bytes and the peak leave them out)
                self.uncounted.setdefault(getattr(self.sink, "name", None), _what(t))
            return
        for st in got:
            self._add_storage(st)

    def _add_storage(self, st: Any) -> None:
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


def _parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors that hold the data of ``t`` where it has a layout or class of its own: a sparse
    tensor's indices and values, a traceable wrapper subclass's inner tensors (a jagged nested
    tensor's values and offsets); None for a plain one."""
    names = SPARSE_PARTS.get(t.layout)
    if names is not None:
        return [getattr(t, n)() for n in names]
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return None
    return [x for a in flatten(t)[0] if isinstance(x := getattr(t, a, None), torch.Tensor)]


def data_bytes(t: torch.Tensor) -> int:
    """Bytes of the data ``t`` holds: ``numel * element_size`` for a strided tensor; a sparse one's
    indices and values, a wrapper subclass's inner tensors, a strided nested one's buffer and
    size, stride and offset tensors (``numel()`` of a sparse tensor is its dense size)."""
    if t.layout is torch.strided and not t.is_nested:
        return t.numel() * t.element_size()
    parts = _parts(t)
    if parts is not None:
        return sum(data_bytes(p) for p in parts)
    if t.is_nested:
        return data_bytes(t.values()) + sum(data_bytes(m) for m in _nested_metadata(t))
    return t.numel() * t.element_size()


def _nested_metadata(t: torch.Tensor) -> list[torch.Tensor]:
    """A strided nested tensor's size, stride and offset tensors (beside its buffer)."""
    try:
        return [
            t._nested_tensor_size(),
            t._nested_tensor_strides(),
            t._nested_tensor_storage_offsets(),
        ]
    except (RuntimeError, NotImplementedError, AttributeError):  # jagged: inner tensors instead
        return []


def _what(t: torch.Tensor) -> str:
    """How an uncounted tensor is named in the summary's warning."""
    kind = type(t).__name__
    return f"{kind} ({t.layout})" if kind != "Tensor" else str(t.layout)


_SHAPE_CODE = flop_counter.shape_wrapper(lambda: 0).__code__


def _registries() -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The formula registry, and its formulas wrapped by shape_wrapper unwrapped: those are called
    on shapes directly (pytree costs ~30 us a call). Rebuilt when a formula has been registered
    since (``register_flop_formula`` adds to torch's registry)."""
    return _registries_for(len(flop_counter.flop_registry))


@functools.lru_cache(maxsize=1)
def _registries_for(size: int) -> tuple[dict[Any, Any], dict[Any, Any]]:
    registry = flop_registry()
    raw = {
        k: v.__wrapped__
        for k, v in registry.items()
        if getattr(v, "__code__", None) is _SHAPE_CODE and hasattr(v, "__wrapped__")
    }
    return registry, raw


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


def _storages(t: torch.Tensor) -> list[Any] | None:
    """The storages holding ``t``'s data: its own (with a strided nested tensor's size, stride and
    offset tensors), or its parts' (:func:`_parts`); None where they cannot be read."""
    try:
        parts = _parts(t)
    except Exception:  # (a subclass whose flattening fails: unknown)
        return None
    if parts is not None:
        out: list[Any] = []
        for p in parts:
            got = _storages(p)
            if got is None:
                return None
            out += got
        return out
    st = _storage(t)
    if st is None:
        return None
    return [st, *(m.untyped_storage() for m in _nested_metadata(t))] if t.is_nested else [st]


def _storage(t: torch.Tensor) -> Any:
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # a lazy module's, unbuilt
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta wrappers...
        return None


# --- Leaf layers run natively ---------------------------------------------------------------------
# A dispatch mode costs every operator a trip through Python (batch_norm, with its 5 tensor
# arguments, ~40 us). For leaf layers of these exact built-in types the operators they run, and so
# FlopCounterMode's count, are known: the summary runs them with the dispatch mode off and counts
# with the same formula from the shapes. tests/summarization/test_summary.py checks each rule against
# FlopCounterMode.


def _one_tensor(args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    return not kw and len(args) == 1 and args[0].__class__ is torch.Tensor


def _conv_flops(module: nn.Module, args: Any, kw: Any, out: torch.Tensor) -> int:
    x, w = args[0], module.weight
    xs, os_ = x.shape, out.shape
    if x.dim() == w.dim() - 1:  # unbatched input: aten.convolution sees a batch of one
        xs, os_ = (1, *xs), (1, *os_)
    transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
    return int(flop_counter.conv_flop_count(xs, w.shape, os_, transposed=transposed))


def _linear_flops(module: nn.Module, args: Any, kw: Any, out: torch.Tensor) -> int:
    # aten: addmm / mm / matmul-as-mm on the flattened rows, whatever the input's rank or layout
    n_in = module.in_features
    return 2 * (args[0].numel() // n_in if n_in else 0) * n_in * module.out_features


def _no_flops(module: nn.Module, args: Any, kw: Any, out: Any) -> int:
    return 0


_MHA_ARGS = ("query", "key", "value")


def _mha_accepts(args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    qkv = [*args[:3], *(kw.get(n) for n in _MHA_ARGS[len(args) :])]
    return (
        len(qkv) == 3
        and all(t.__class__ is torch.Tensor for t in qkv)
        and all(  # masks too: a tensor subclass has its own __torch_dispatch__
            v.__class__ is torch.Tensor
            for v in (*args[3:], *kw.values())
            if isinstance(v, torch.Tensor)
        )
    )


def _mha_flops(module: nn.Module, args: Any, kw: Any, out: Any) -> int:
    """``F.multi_head_attention_forward``'s FLOPs as the dispatcher counts them: the in-projections
    (packed or not: the same total), q @ k^T and weights @ v (bmm/baddbmm, or one SDPA whose formula
    is those two), the out-projection. ``bias_k`` and ``add_zero_attn`` each add a key."""
    q, k = (*args[:3], *(kw.get(n) for n in _MHA_ARGS[len(args) :]))[:2]
    e, kdim, vdim = module.embed_dim, module.kdim, module.vdim
    if q.dim() == 2:  # unbatched: (L, E)
        n, lq, s = 1, q.shape[0], k.shape[0]
    elif module.batch_first:  # (N, L, E)
        n, lq, s = q.shape[0], q.shape[1], k.shape[1]
    else:  # (L, N, E)
        n, lq, s = q.shape[1], q.shape[0], k.shape[0]
    keys = s + (module.bias_k is not None) + bool(module.add_zero_attn)
    proj = 2 * n * (lq * e * e + s * kdim * e + s * vdim * e) + 2 * n * lq * e * e
    return proj + 4 * n * lq * keys * e


class _Rule:
    """How a leaf layer is counted natively: ``flops(module, args, kwargs, output)``, for calls
    ``accepts(args, kwargs)`` (the inputs it was checked on). ``fastpath``: the layer may take
    PyTorch's MHA fast path, when the user has it on (the count does not depend on the kernel)."""

    __slots__ = ("accepts", "fastpath", "flops")

    def __init__(self, flops: Any, accepts: Any = _one_tensor, fastpath: bool = False) -> None:
        self.flops, self.accepts, self.fastpath = flops, accepts, fastpath


_conv = nn.modules.conv
_CONV, _LINEAR, _ZERO = _Rule(_conv_flops), _Rule(_linear_flops), _Rule(_no_flops)
_MHA = _Rule(_mha_flops, _mha_accepts, fastpath=True)
_NATIVE: dict[type, _Rule] = {
    **dict.fromkeys(
        (
            _conv.Conv1d,
            _conv.Conv2d,
            _conv.Conv3d,
            _conv.ConvTranspose1d,
            _conv.ConvTranspose2d,
            _conv.ConvTranspose3d,
        ),
        _CONV,
    ),
    nn.Linear: _LINEAR,
    # calls no module of its own: out_proj's weight is used by F.multi_head_attention_forward
    nn.MultiheadAttention: _MHA,
    # No operator of these has a FlopCounterMode formula, nor decomposes into one that has.
    **dict.fromkeys(
        (
            nn.BatchNorm1d,
            nn.BatchNorm2d,
            nn.BatchNorm3d,
            nn.LayerNorm,
            nn.GroupNorm,
            nn.ReLU,
            nn.ReLU6,
            nn.LeakyReLU,
            nn.GELU,
            nn.SiLU,
            nn.Sigmoid,
            nn.Tanh,
            nn.Hardswish,
            nn.Hardsigmoid,
            nn.ELU,
            nn.Softmax,
            nn.Dropout,
            nn.Identity,
            nn.Flatten,
            nn.MaxPool1d,
            nn.MaxPool2d,
            nn.MaxPool3d,
            nn.AvgPool1d,
            nn.AvgPool2d,
            nn.AvgPool3d,
            nn.AdaptiveAvgPool1d,
            nn.AdaptiveAvgPool2d,
            nn.AdaptiveAvgPool3d,
            nn.Embedding,
        ),
        _ZERO,
    ),
}


def native_rule(module: nn.Module) -> _Rule | None:
    """How ``module`` is counted when it runs with the dispatch mode off, or None if it must run
    with it on: it must be an exact built-in type from the table above, with no forward of its own
    set on the instance, no children it calls, no hooks (a hook could run other operators), and
    plain tensors for parameters and buffers (a subclass has its own ``__torch_dispatch__``)."""
    rule = _NATIVE.get(type(module))
    if rule is None or "forward" in module.__dict__ or (module._modules and rule is not _MHA):
        return None
    inner = list(module.modules()) if module._modules else [module]
    plain = (nn.Parameter, torch.Tensor, getattr(nn, "Buffer", torch.Tensor))
    for m in inner:
        if not all(_runs_no_ops(h) for h in module_hooks(m)):
            return None
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and type(t) not in plain:
                return None
    return rule


def _runs_no_ops(hook: Any) -> bool:
    """A hook known to run no operator: the command line's error locator."""
    return isinstance(hook, _Hook) and hook.owner == "locate_errors"


no_dispatch = torch._C._DisableTorchDispatch
"""A guard object: while it is alive, no dispatch mode sees the operators run (C++, ~0.2 us)."""
