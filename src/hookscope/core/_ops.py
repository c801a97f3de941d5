"""Ready-made edits for activations and gradients: ``hs.ops.zero()``, ``hs.ops.clamp(min=0)``, ...

Each op is a small callable ``op(tensor) -> tensor`` that always returns a *new* tensor (never
modifies its input in place: a gradient edited in place could change the caller's
``backward(gradient=g)`` tensor, docs/pitfalls.md §24) and never synchronises with the device. Applied to a
nested value (a tuple or dict output), an op is applied to every tensor inside it.

Example:
    >>> import torch, hookscope as hs
    >>> hs.ops.clamp(min=0)(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ._errors import HookscopeError

__all__ = ["Op", "ablate", "add", "clamp", "clip_norm", "replace", "scale", "zero"]


def _number(v: Any, what: str, tensor: bool = True) -> Any:
    """Refuse, when the op is made, a value that is not a finite number (or a tensor)."""
    if tensor and isinstance(v, torch.Tensor):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        kinds = "a finite number or a tensor" if tensor else "a finite number"
        raise TypeError(f"{what} must be {kinds}; got {type(v).__name__}: {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite; got {v}")
    return v


class Op:
    """Base class of hookscope's tensor edits: ``op(tensor) -> new tensor``."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"hs.ops.{type(self).__name__.lower().lstrip('_')}({args})"


class _Zero(Op):
    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t)


class _Scale(Op):
    def __init__(self, k: float | torch.Tensor) -> None:
        self.k = _number(k, "hs.ops.scale: k")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.k


class _Add(Op):
    def __init__(self, v: float | torch.Tensor) -> None:
        self.v = _number(v, "hs.ops.add: v")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        v = self.v
        if isinstance(v, torch.Tensor):
            v = v.to(device=t.device, dtype=t.dtype if t.is_floating_point() else v.dtype)
        return t + v


class _Clamp(Op):
    def __init__(self, min: float | None = None, max: float | None = None) -> None:
        if min is None and max is None:
            raise ValueError("clamp needs min, max or both")
        for name, v in (("min", min), ("max", max)):
            if v is not None:
                _number(v, f"hs.ops.clamp: {name}", tensor=False)
        if min is not None and max is not None and min > max:
            raise ValueError(f"clamp: min={min} is greater than max={max}")
        self.min, self.max = min, max

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.clamp(min=self.min, max=self.max)


class _Replace(Op):
    def __init__(self, value: torch.Tensor | float) -> None:
        if not isinstance(value, torch.Tensor) and (
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise TypeError(
                f"hs.ops.replace: value must be a number or a tensor; got {type(value).__name__}: {value!r}"
            )
        self.value = value

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        v = self.value
        if not isinstance(v, torch.Tensor):
            return torch.full_like(t, v)
        v = v.to(
            device=t.device,
            dtype=t.dtype if t.is_floating_point() and v.is_floating_point() else v.dtype,
        )
        if v.shape != t.shape:
            try:
                v = torch.broadcast_to(v, t.shape)
            except RuntimeError:
                raise ValueError(
                    f"replace: the replacement has shape {tuple(v.shape)}, which does not broadcast to "
                    f"the value's shape {tuple(t.shape)}"
                ) from None
        return v.clone() if v.data_ptr() == t.data_ptr() else v


class _Ablate(Op):
    def __init__(self, channels: int | Sequence[int] | torch.Tensor, dim: int = 1) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"hs.ops.ablate: dim must be an int; got {type(dim).__name__}: {dim!r}")
        try:
            idx = torch.as_tensor(
                [channels] if isinstance(channels, int) else channels, dtype=torch.long
            )
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"hs.ops.ablate: channels must be an int or a list of ints; got {channels!r}"
            ) from None
        if idx.ndim != 1:
            raise ValueError(
                f"ablate: channels must be an int or a 1-D list of ints, got shape {tuple(idx.shape)}"
            )
        self.channels, self.dim = idx.tolist(), dim
        self._idx = idx

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim >= 0 else t.ndim + self.dim
        if not 0 <= dim < t.ndim:
            raise ValueError(
                f"ablate: dim={self.dim} is out of range for a tensor of shape {tuple(t.shape)}"
            )
        size = t.shape[dim]
        bad = [c for c in self.channels if not -size <= c < size]
        if bad:
            raise ValueError(
                f"ablate: channel(s) {bad} out of range for size {size} along dim {dim}"
            )
        idx = self._idx.to(t.device) % size
        return t.index_fill(dim, idx, 0)


class _ClipNorm(Op):
    def __init__(self, max_norm: float, eps: float = 1e-6) -> None:
        _number(max_norm, "hs.ops.clip_norm: max_norm", tensor=False)
        if max_norm <= 0:
            raise ValueError(f"hs.ops.clip_norm: max_norm must be > 0, got {max_norm}")
        self.max_norm, self.eps = max_norm, eps

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(t.float())
        factor = (self.max_norm / (norm + self.eps)).clamp(max=1.0)
        return t * factor.to(t.dtype)


def zero() -> Op:
    """Replace every value by 0 (``zeros_like``)."""
    return _Zero()


def scale(k: float | torch.Tensor) -> Op:
    """Multiply by ``k``."""
    return _Scale(k)


def add(v: float | torch.Tensor) -> Op:
    """Add ``v`` (broadcast)."""
    return _Add(v)


def clamp(min: float | None = None, max: float | None = None) -> Op:
    """Clamp into ``[min, max]`` (either may be omitted)."""
    return _Clamp(min, max)


def replace(value: torch.Tensor | float) -> Op:
    """Replace by ``value`` (a scalar, or a tensor broadcast to the shape; moved to its device)."""
    return _Replace(value)


def ablate(channels: int | Sequence[int] | torch.Tensor, dim: int = 1) -> Op:
    """Zero the given channels along ``dim`` (dim 1 is the channel dim of ``(N, C, ...)``)."""
    return _Ablate(channels, dim)


def clip_norm(max_norm: float) -> Op:
    """Rescale so the L2 norm is at most ``max_norm`` (no host sync)."""
    return _ClipNorm(max_norm)


def apply(fn: Any, value: Any, what: str) -> Any:
    """Apply an op, a tensor (replacement) or a user function to a (nested) value; validate."""
    from ._nested import map_tensors

    if isinstance(fn, torch.Tensor):
        fn = _Replace(fn)
    if isinstance(fn, Op):
        return fn(value) if isinstance(value, torch.Tensor) else map_tensors(fn, value)
    if not callable(fn):
        raise TypeError(
            f"the edit for {what} must be a hs.ops op, a tensor or a callable; got {type(fn).__name__}"
        )
    new = fn(value)
    if new is None:
        return value
    if isinstance(value, torch.Tensor) and not isinstance(new, torch.Tensor):
        raise TypeError(
            f"the edit function for {what} returned {type(new).__name__}; it must return a Tensor (the new "
            "value) or None (keep the value). A hook that returns e.g. a RemovableHandle by accident "
            "would otherwise replace the layer's output (docs/pitfalls.md §11)"
        )
    _check_same_kind(value, new, what)
    return new


def _check_same_kind(value: Any, new: Any, what: str) -> None:
    """Refuse an edit whose result changes a tensor's shape or dtype (the tensor itself, or a
    tensor at the same place of a nested value), naming ``what`` it edited."""
    if isinstance(value, torch.Tensor):
        pairs = [((), value, new)]
    else:
        from ._nested import iter_tensors

        before = dict(iter_tensors(value))
        pairs = [(p, before[p], t) for p, t in iter_tensors(new) if p in before]
    for path, old, t in pairs:
        if t.shape != old.shape or t.dtype != old.dtype:
            where = f" (item {'.'.join(map(str, path))})" if path else ""
            raise HookscopeError(
                f"the edit function for {what}{where} returned shape {tuple(t.shape)} and dtype "
                f"{t.dtype}, but the value it edits has shape {tuple(old.shape)} and dtype "
                f"{old.dtype}; an edit must keep both (cast with .to({old.dtype}), keep the batch "
                "dimension, or edit a layer whose output has the shape you mean)"
            )
