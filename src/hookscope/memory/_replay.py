"""What one call of a checkpointed module starts from, so that its recompute replays that call.

``torch.utils.checkpoint`` runs a module's forward a second time in backward. Whatever that
forward changes besides its output changes twice, and whatever changed between the call and
backward is seen by the recompute. :class:`CallState` records, at each call with grad enabled,
what the recompute needs to see the call's own starting point and to leave no trace:

* **buffers** (BatchNorm's running statistics and ``num_batches_tracked``, spectral norm's
  vectors, any buffer the forward updates in place or reassigns): which ones a forward changes
  is learned from the run, not from the module's type. The first training call of a wrapper
  keeps a copy of every buffer of the subtree and compares (values: BatchNorm updates its
  statistics without bumping their version counters); later calls keep copies of the buffers
  seen changing and watch the others' version counters and identities (a buffer first seen
  changing then is named in a warning, and kept from then on). The recompute runs from the
  values at the call, and the buffers are put back to what they hold when backward reaches the
  module (version counters untouched: nothing autograd saved is invalidated). Statistics are
  thus updated once per forward, as without checkpointing, and a forward that reads a buffer
  it updates recomputes exactly;
* **plain attributes** (numbers, strings, None, tensors) of every module of the subtree (a step
  counter, a cached tensor, ``training``: ``model.eval()`` between forward and backward no
  longer turns dropout off in the recompute): set back to their values at the call for the
  recompute, and put back after;
* **inputs changed in place**: a module that changes one of its inputs in place makes its own
  recompute start from the changed value (silently wrong gradients under
  ``saved_tensors_hooks``, e.g. ``save_on_cpu``, a cryptic autograd error otherwise); such a
  call raises at once, naming the layer, and a recompute whose inputs were changed after the
  call raises before running;
* **key/value caches** (a Hugging Face ``Cache`` passed to an attention layer or a decoder block
  with ``use_cache=True``): the call appends to the cache; its recompute runs with the cache off
  (``None``, ``use_cache=False``), what Transformers' own gradient checkpointing does for the
  whole step. Exact when the cache held nothing for the layer before the call (a training
  step); a call made with a cache that already holds this layer's positions is refused.
* **random numbers**: ``torch.utils.checkpoint`` restores the CPU generator and those of the
  devices of the *positional* inputs; the CUDA generators of devices seen only through keyword
  inputs or the module's parameters are restored here.

What is not restored: other objects a forward changes (an attribute holding an instance of
your own class), and state outside the checkpointed module. A tensor attribute (not a buffer)
changed in place by the recompute changed twice: no copy was kept, and a warning names it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from ..core._buffers import Containers, plain_attributes
from ..core._errors import HookscopeError, HookscopeWarning
from ..core._nested import iter_tensors

__all__ = ["CallState", "ModuleMemory", "cache_arguments"]

_MISSING = object()


def _is_cache(value: Any) -> bool:
    """A key/value cache object (Transformers' ``Cache`` and its subclasses, found by duck typing:
    hookscope imports no model library)."""
    if value is None or isinstance(value, (torch.Tensor, int, float, str, bool)):
        return False
    cls = type(value)
    if any(c.__name__.endswith("Cache") for c in cls.__mro__):
        return True
    return callable(getattr(value, "get_seq_length", None)) and callable(
        getattr(value, "update", None)
    )


def cache_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The positions (ints) and keyword names (strs) of key/value caches among a call's inputs."""
    where: list[Any] = [i for i, a in enumerate(args) if _is_cache(a)]
    where += [k for k, v in kwargs.items() if _is_cache(v)]
    return where


def _layer_indices(module: nn.Module) -> list[int]:
    idx = {getattr(m, "layer_idx", None) for m in module.modules()}
    return sorted(i for i in idx if isinstance(i, int) and not isinstance(i, bool))


def _held(cache: Any, layers: list[int]) -> int | None:
    """Positions ``cache`` already holds for ``layers`` (all layers when none are known); None
    when the cache cannot tell."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        held = max((int(length(i)) for i in layers), default=0) if layers else int(length())
    except Exception:
        return None
    updated = getattr(cache, "is_updated", None)  # an encoder-decoder cache's cross-attention
    if isinstance(updated, dict) and any(updated.get(i) for i in (layers or list(updated))):
        held = max(held, 1)
    return held


def _bookkeeping() -> Any:
    """Copies made for the replay run outside every dispatch mode: selective checkpointing's
    (which replays the recompute's operations one for one) and memory_profile's (which counts
    the model's own operations) do not see them."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


class ModuleMemory:
    """Per checkpointed module (one per wrapper): which buffers its forward was seen changing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.changing: set[tuple[str, str]] = set()  # (submodule, buffer) seen changing
        self.explored = False  # a training call has shown which buffers change
        self.warned: set[tuple[str, str]] = set()


def _slots(module: nn.Module) -> list[tuple[tuple[str, str], nn.Module]]:
    return [
        ((prefix, b), m)
        for prefix, m in module.named_modules(remove_duplicate=False)
        for b in m._buffers
    ]


def _set_buffer(m: nn.Module, name: str, obj: Any, value: torch.Tensor | None) -> None:
    """Put ``obj`` in the slot and, with ``value``, its data back, without bumping its version
    counter (a tensor autograd saved stays valid)."""
    m._buffers[name] = obj
    if value is not None and isinstance(obj, torch.Tensor):
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(obj):
            obj.copy_(value)


class CallState:
    """The state one call of a checkpointed module starts from (see the module docstring).

    ``run`` is the function given to ``torch.utils.checkpoint``: its first invocation is the
    call itself, every later one a recompute.
    """

    def __init__(
        self,
        module: nn.Module,
        memory: ModuleMemory,
        forward: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.module, self.memory, self.forward = module, memory, forward
        self.started = False
        self.caches = cache_arguments(args, kwargs)
        if self.caches:
            self._check_caches(args, kwargs)
        # the call's own tensors (weakly: a saved-tensor hook may give the recompute copies)
        self.inputs = [(weakref.ref(t), t._version) for _, t in iter_tensors((args, kwargs))]
        self.attrs = [(m, plain_attributes(m.__dict__)) for m in module.modules()]
        self.containers = Containers(module.modules())
        keep_all = not memory.explored
        self.buffers: dict[tuple[str, str], tuple[nn.Module, Any, int, Any]] = {}
        slots = _slots(module)
        if slots:
            with _bookkeeping():
                for key, m in slots:
                    b = m._buffers[key[1]]
                    clone = None
                    if isinstance(b, torch.Tensor) and (keep_all or key in memory.changing):
                        clone = b.detach().clone()
                    version = b._version if isinstance(b, torch.Tensor) else -1
                    self.buffers[key] = (m, b, version, clone)
        self.rng = self._extra_rng(args, kwargs)

    # -- at the call ------------------------------------------------------------------------------
    def _check_caches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        layers = _layer_indices(self.module)
        for where in self.caches:
            cache = args[where] if isinstance(where, int) else kwargs[where]
            held = _held(cache, layers)
            if held != 0:
                what = "an unknown number of" if held is None else str(held)
                raise HookscopeError(
                    f"apply_checkpointing: layer {self.memory.name!r} was called with a "
                    f"key/value cache ({type(cache).__name__}) that already holds {what} "
                    "position(s) for it; its recompute in backward cannot replay that cache. "
                    "Train with use_cache=False (and no past_key_values), as Transformers' "
                    "gradient_checkpointing_enable does, or leave this layer out of the plan"
                )

    def _extra_rng(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Any]:
        """CUDA generator states of devices that ``torch.utils.checkpoint`` does not restore
        (seen only through keyword inputs or the module's parameters)."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        seen = {t.device.index for _, t in iter_tensors(args) if t.is_cuda}
        other = {t.device.index for _, t in iter_tensors(kwargs) if t.is_cuda}
        p = next(self.module.parameters(), None)
        if p is not None and p.is_cuda:
            other.add(p.device.index)
        return {
            d: torch.cuda.get_rng_state(d) for d in sorted(i for i in other - seen if i is not None)
        }

    def after_call(self) -> None:
        """Right after the call: refuse a module that changed its own inputs in place, learn
        which buffers its forward changes and drop the copies of those it did not change."""
        memory, name = self.memory, self.memory.name
        if self.module.training:
            memory.explored = True
        for key, (m, b, version, clone) in list(self.buffers.items()):
            if key in memory.changing:
                continue  # known to change: its copy is kept for the recompute
            now = m._buffers.get(key[1], _MISSING)
            # a native op (BatchNorm's statistics) may update a buffer without bumping its
            # version counter: where a copy was kept, the values tell
            with _bookkeeping():
                in_place = isinstance(b, torch.Tensor) and (
                    b._version != version or (clone is not None and not _same(clone, b))
                )
            if now is b and not in_place:
                del self.buffers[key]  # unchanged: nothing to replay
                continue
            memory.changing.add(key)
            if clone is None and in_place and key not in memory.warned:
                memory.warned.add(key)
                full = ".".join(p for p in (name, *key) if p)
                warnings.warn(
                    f"apply_checkpointing: buffer {full!r} changed in a call of layer {name!r} "
                    "where its earlier training calls left it alone, so its value before this "
                    "call was not kept: this call's recompute starts from the changed value (the "
                    "buffer is put back after it). Later calls keep it and are exact; leave this "
                    "layer out of the checkpointed modules if every step must be exact",
                    HookscopeWarning,
                    stacklevel=4,
                )

    def check_inputs(self, when: str) -> None:
        """Raise if one of the call's input tensors was changed in place since the call."""
        for i, (ref, version) in enumerate(self.inputs):
            t = ref()
            if t is not None and t._version != version:
                name = self.memory.name
                raise HookscopeError(
                    f"apply_checkpointing: input {i} of layer {name!r} "
                    f"({type(self.module).__name__}) was changed in place {when}, so its "
                    "recompute in backward would start from the changed value (wrong gradients, "
                    "or an autograd error); leave this layer out of the checkpointed modules (an "
                    "in-place module such as ReLU(inplace=True) is never safe to checkpoint "
                    "alone), or checkpoint the block that contains it"
                )

    # -- the function torch.utils.checkpoint calls ------------------------------------------------
    def run(self, *args: Any, **kwargs: Any) -> Any:
        if not self.started:
            self.started = True
            return self.forward(*args, **kwargs)
        return self.recompute(args, kwargs)

    def recompute(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.check_inputs("after its call")
        if self.caches:
            args, kwargs = list(args), dict(kwargs)  # type: ignore[assignment]
            for where in self.caches:
                if isinstance(where, int):
                    args[where] = None  # type: ignore[index]
                else:
                    kwargs[where] = None
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            args = tuple(args)
        undo = self._enter()
        try:
            return self._forward_replayed(args, kwargs)
        finally:  # (torch.utils.checkpoint may stop a recompute early, by an exception)
            self._leave(undo)
            self._warn_tensor_attributes()

    def _forward_replayed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.rng:
            devices = list(self.rng)
            with torch.random.fork_rng(devices=devices, device_type="cuda"):
                for d, state in self.rng.items():
                    torch.cuda.set_rng_state(state, d)
                return self.forward(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def _enter(self) -> tuple[list[Any], list[Any], Containers]:
        """Set the buffers, attributes and containers to their values at the call; return what
        to put back."""
        bufs: list[Any] = []
        if self.buffers:
            with _bookkeeping():
                for key, (m, b, _v, clone) in self.buffers.items():
                    now = m._buffers.get(key[1], _MISSING)
                    keep = now.detach().clone() if isinstance(now, torch.Tensor) else None
                    bufs.append((m, key[1], now, keep))
                    _set_buffer(m, key[1], b, clone)
        attrs: list[Any] = []
        for m, before in self.attrs:
            d = m.__dict__
            now = plain_attributes(d)
            if now.keys() == before.keys() and all(now[k] is v for k, v in before.items()):
                continue
            attrs.append((m, {k: d.get(k, _MISSING) for k in now.keys() | before.keys()}))
            for k in now.keys() - before.keys():
                del d[k]
            d.update(before)
        now_held = Containers(self.module.modules())
        self.containers.restore()
        self.tensors = [
            (m, k, v, v._version)
            for m in self.module.modules()
            for k, v in plain_attributes(m.__dict__).items()
            if isinstance(v, torch.Tensor)
        ]
        return bufs, attrs, now_held

    def _warn_tensor_attributes(self) -> None:
        """Warn about tensor attributes (not buffers) the recompute changed in place: they
        changed twice this step, and no copy was kept to put them back."""
        for m, k, v, version in self.tensors:
            if v._version != version:
                sub = next((n for n, x in self.module.named_modules() if x is m), "")
                full = ".".join(p for p in (self.memory.name, sub, k) if p)
                warnings.warn(
                    f"apply_checkpointing: attribute {full!r} (a tensor, not a buffer) was "
                    f"changed in place by the recompute of layer {self.memory.name!r}, so it "
                    "changed twice this step; register it as a buffer (register_buffer(..., "
                    "persistent=False): buffers are replayed), or leave this layer out of the "
                    "checkpointed modules",
                    HookscopeWarning,
                    stacklevel=2,
                )

    @staticmethod
    def _leave(undo: tuple[list[Any], list[Any], Containers]) -> None:
        bufs, attrs, held = undo
        if bufs:
            with _bookkeeping():
                for m, name, obj, value in reversed(bufs):
                    if obj is _MISSING:
                        m._buffers.pop(name, None)
                    else:
                        _set_buffer(m, name, obj, value)
        for m, saved in attrs:
            d = m.__dict__
            for k, v in saved.items():
                if v is _MISSING:
                    d.pop(k, None)
                else:
                    d[k] = v
        held.restore()
