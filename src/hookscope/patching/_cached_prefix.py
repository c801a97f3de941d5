"""A causal language model run again from position ``p0`` on, the positions before it taken from a
reference run's key/value cache.

In a causal model the values at position ``t`` depend only on positions ``<= t``. A change made at
positions ``>= p0`` (a patched activation, a steering vector) leaves every position before ``p0``
of every layer equal to the reference run, so a pass needs to compute only ``p0..T-1``: the
attention of those positions reads the reference run's keys and values of ``0..p0-1`` from a cache.

:class:`CausalPrefix` does this for a Hugging Face model without a table per architecture: its
forward takes ``past_key_values`` and ``use_cache``, its attention modules say ``is_causal``, and
the reference run (with ``use_cache=True``) returned a ``transformers`` ``DynamicCache`` of plain
``DynamicLayer`` s (no sliding window, no linear attention, no offloading). A pass calls the model
on the inputs sliced to ``p0..T-1`` (``input_ids``, ``inputs_embeds``, ``token_type_ids``,
``position_ids``; the ``attention_mask`` stays full length, Hugging Face's convention for a cache
plus new tokens) with a fresh cache of the reference keys and values before ``p0``. A cache layer
tiles its rows when a pass runs ``k`` copies of the batch from some block on (``_batching.FanOut``).
:meth:`CausalPrefix.rebuild` puts the reference run's first ``p0`` positions back in front of each
output tensor, so a caller sees what a full run gives (a model whose output holds a tensor without
a position axis, e.g. a classifier pooled at each row's last real token, runs at full length: from
``p0`` on it would pool only the later positions). Callers check the first pass against a full
run and fall back where it differs: the conditions above are necessary, not a proof.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import is_optimized, named_modules
from ..core._errors import HookscopeError
from ..core._nested import iter_tensors, map_tensors
from ..core._signature import forward_parameters
from ._batching import tile

__all__ = ["CausalPrefix", "PrefixError", "drop_cache", "wants_cache"]

# inputs with a position axis (dim 1, or the last for position ids) sliced to p0..T-1
_SLICED = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids")
_KEPT = ("attention_mask", "use_cache", "past_key_values")


class PrefixError(HookscopeError):
    """A pass from ``p0`` cannot be built or its output cannot be rebuilt (the sweep falls back to
    full-length passes, with a warning)."""


def wants_cache(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a run of ``model`` on ``kwargs`` may give a usable cache: the forward takes
    ``past_key_values`` and ``use_cache``, nothing in it is compiled (every new length would
    recompile), every module that says ``is_causal`` says ``True`` (at least one does), the
    tensor inputs are only the kinds a pass can slice, and a 2-D mask."""
    params = set(forward_parameters(model))
    if not {"past_key_values", "use_cache"} <= params:
        return False
    for m in model.modules():  # compiled code would recompile for every new length
        if is_optimized(m) or getattr(m, "_compiled_call_impl", None) is not None:
            return False
    causal = [
        m.is_causal
        for _, m in named_modules(model)
        if isinstance(getattr(m, "is_causal", None), bool)
    ]
    if not causal or not all(causal):
        return False
    for k, v in kwargs.items():
        if k in _KEPT:
            continue
        if isinstance(v, torch.Tensor) and k not in _SLICED:
            return False
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim != 2:
        return False
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    return isinstance(ids, torch.Tensor) and ids.ndim >= 2


@functools.cache
def _tiling_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class TilingLayer(DynamicLayer):  # type: ignore[misc, valid-type]
        """A ``DynamicLayer`` whose stored rows are tiled ``k`` times when ``k`` times as many
        rows arrive (a pass whose rows fan out at or before this layer)."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if self.is_initialized and self.keys.numel():
                have, new = self.keys.shape[0], key_states.shape[0]
                if new != have and new % have == 0:
                    self.keys = tile(self.keys, have, new // have)
                    self.values = tile(self.values, have, new // have)
            return super().update(key_states, value_states, *args, **kwargs)

    return TilingLayer


def drop_cache(out: Any) -> Any:
    """``out`` with any cache object (a non-tensor leaf from ``transformers``) set to ``None``."""

    def other(v: Any) -> Any:
        mod = type(v).__module__ or ""
        return None if mod.startswith("transformers") and hasattr(v, "get_seq_length") else v

    return map_tensors(lambda t: t, out, other)


def _positional(output: Any, length: int) -> bool:
    """Whether every tensor of ``output`` has a position axis (a dimension after the batch's of
    ``length``): a pass from ``p0`` rebuilds those; a tensor without one (a classifier's logits
    pooled at each row's last real token, an auxiliary loss) may read positions before ``p0``,
    which such a pass does not compute, so the model runs at full length."""
    return all(length in t.shape[1:] for _, t in iter_tensors(output))


class CausalPrefix:
    """The reference run of a causal HF model, to run passes from position ``p0`` on.

    Build it with :meth:`from_run` (``None`` where the model gave no usable cache). ``length`` is
    the sequence length ``T``, ``output`` the reference output without its cache,
    ``cache_bytes_per_row`` what the keys and values of a full-length row take.
    """

    def __init__(
        self, kwargs: dict[str, Any], output: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.kwargs = kwargs
        self.output = drop_cache(output)
        self.kv = kv
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        assert isinstance(ids, torch.Tensor)
        self.batch, self.length = int(ids.shape[0]), int(ids.shape[1])
        self.cache_bytes_per_row = sum(k.nbytes + v.nbytes for k, v in kv) // max(1, self.batch)
        self.axes: list[int | None] = []

    @classmethod
    def from_run(cls, kwargs: dict[str, Any], output: Any) -> CausalPrefix | None:
        """From the inputs and the output of a ``use_cache=True`` run; ``None`` where its
        ``past_key_values`` is not a ``DynamicCache`` of plain full-length layers, or a tensor of
        the output has no position axis (a pooled head: :func:`_positional`)."""
        cache = getattr(output, "past_key_values", None)
        if cache is None and isinstance(output, dict):
            cache = output.get("past_key_values")
        if cache is None or not (type(cache).__module__ or "").startswith("transformers"):
            return None
        from transformers.cache_utils import DynamicCache, DynamicLayer

        if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
            return None
        layers = list(getattr(cache, "layers", []))
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            return None
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        assert isinstance(ids, torch.Tensor)
        kv = []
        for layer in layers:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                return None
            if k.ndim != 4 or k.shape[0] != ids.shape[0] or k.shape[-2] != ids.shape[1]:
                return None
            kv.append((k, v))
        if not _positional(drop_cache(output), int(ids.shape[1])):
            return None
        return cls(kwargs, output, kv)

    def inputs(self, p0: int) -> dict[str, Any]:
        """The keyword inputs of a pass over positions ``p0..T-1``: the sliced inputs, the full
        mask, ``use_cache=True`` and a fresh cache holding the reference keys/values of
        positions ``< p0``."""
        from transformers.cache_utils import DynamicCache

        cls = _tiling_layer()
        cache = DynamicCache()
        for k, v in self.kv:
            layer = cls()
            layer.update(k[..., :p0, :], v[..., :p0, :])
            cache.layers.append(layer)
        out: dict[str, Any] = {}
        for name, value in self.kwargs.items():
            if name in _SLICED and isinstance(value, torch.Tensor):
                value = value[..., p0:] if name == "position_ids" else value[:, p0:]
            out[name] = value
        out["use_cache"] = True
        out["past_key_values"] = cache
        return out

    def rebuild(self, out: Any, p0: int) -> Any:
        """One copy's rows of a pass from ``p0`` (``B`` rows), as a full run gives them: each
        tensor that is ``T - p0`` long where the reference's is ``T`` gets the reference's first
        ``p0`` positions in front; the cache is dropped. Raises :class:`PrefixError` where the
        output does not match the reference's structure, or a tensor has no position axis."""
        out = drop_cache(out)
        refs = [t for _, t in iter_tensors(self.output)]
        got = [t for _, t in iter_tensors(out)]
        if len(refs) != len(got):
            raise PrefixError(f"the pass gave {len(got)} output tensors, the full run {len(refs)}")
        it = iter(refs)
        short = self.length - p0
        axes: list[int | None] = []  # the position axis of each tensor

        def one(t: torch.Tensor) -> torch.Tensor:
            ref = next(it)
            if t.shape == ref.shape:  # no position axis: it may read every position (pooled)
                raise PrefixError(
                    f"an output tensor is {tuple(t.shape)} both from p0={p0} and in the full run: "
                    "it has no position axis to rebuild (a value pooled over the positions, e.g. "
                    "at each row's last real token, sees only those from p0 on)"
                )
            dims = [d for d in range(t.ndim) if t.ndim == ref.ndim and t.shape[d] != ref.shape[d]]
            if len(dims) != 1 or ref.shape[dims[0]] != self.length or t.shape[dims[0]] != short:
                raise PrefixError(
                    f"an output tensor is {tuple(t.shape)} from p0={p0}, {tuple(ref.shape)} in "
                    "the full run"
                )
            d = dims[0]
            if d == 0:
                raise PrefixError("the position axis cannot be the batch axis")
            axes.append(d)
            return torch.cat([ref.narrow(d, 0, p0).to(t.dtype), t], dim=d)

        rebuilt = map_tensors(one, out)
        self.axes = axes
        return rebuilt

    def padding_from(self, full: Any, rebuilt: Any, p0: int) -> Any:
        """``full`` (a full run's output, ``B`` rows) with its padding positions before ``p0``
        (``attention_mask`` 0) and each row's padding before its first real token (left padding,
        at any position) taken from ``rebuilt`` (the last :meth:`rebuild`'s structure).

        A position before a row's first real token attends to no real key; Hugging Face lets it
        attend to every position instead, so a full run's output there changes with a patch
        anywhere, while a pass from ``p0`` keeps the reference's before ``p0`` and attends to
        what the pass holds from ``p0`` on. Neither means anything; this makes the two
        comparable on the positions that do."""
        mask = self.kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor):
            return full
        pad = mask == 0
        pad[:, p0:] &= mask.cumsum(1)[:, p0:] == 0  # from p0 on: leading padding only
        if not bool(pad.any()):
            return full
        got = [t for _, t in iter_tensors(rebuilt)]
        it = iter(zip(got, self.axes))

        def one(t: torch.Tensor) -> torch.Tensor:
            g, d = next(it)
            if d is None or t.shape != g.shape or t.shape[0] != pad.shape[0]:
                return t
            if t.shape[d] != pad.shape[1]:
                return t
            shape = [1] * t.ndim
            shape[0], shape[d] = pad.shape
            return torch.where(pad.to(t.device).view(shape).expand(t.shape), g, t)

        return map_tensors(one, full)
