"""Ready-made edits for activations and gradients: ``hs.ops.zero()``, ``hs.ops.clamp(min=0)``, ...

Each op is a small callable ``op(tensor) -> tensor`` that always returns a *new* tensor (never
modifies its input in place: a gradient edited in place could change the caller's
``backward(gradient=g)`` tensor, docs/pitfalls.md §24; never the op's own argument, which the
model could then change in place) and never synchronises with the device. Applied to a
nested value (a tuple or dict output), an op is applied to every tensor inside it.

An op keeps the dtype and shape of the tensor it edits, or refuses (:class:`~hookscope.HookscopeError`,
which :func:`apply` names with the layer): a tensor argument of another floating dtype is applied in
the wider dtype and the result rounded once to the tensor's dtype (what a hand-written
``(out * k).to(out.dtype)`` gives, bit for bit), and an integer tensor is never turned into a
float one (``scale(2.5)`` refused, ``clamp(min=1.5)`` is ``clamp(min=2)``, exactly).

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


class _OpError(HookscopeError, ValueError):
    """An op cannot give the tensor it edits a value of the same dtype and shape (a
    :class:`HookscopeError`; :func:`apply` adds the layer it edits)."""


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
        args = ", ".join(f"{k}={_show(v)}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"hs.ops.{self._public}({args})"

    @property
    def _public(self) -> str:
        return type(self).__name__.lower().lstrip("_")


def _show(v: Any) -> str:
    """A value in an op's repr: a tensor by its shape and dtype (its values could be many)."""
    if isinstance(v, torch.Tensor) and v.numel() > 1:
        return f"<tensor {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}>"
    return repr(v)


class _Zero(Op):
    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t)


class _Scale(Op):
    def __init__(self, k: float | torch.Tensor) -> None:
        self.k = _number(k, "hs.ops.scale: k")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return _same_kind(t, torch.mul, self.k, self)


class _Add(Op):
    def __init__(self, v: float | torch.Tensor) -> None:
        self.v = _number(v, "hs.ops.add: v")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return _same_kind(t, torch.add, self.v, self)


def _same_kind(t: torch.Tensor, fn: Any, k: Any, op: Op) -> torch.Tensor:
    """``fn(t, k)`` with ``t``'s dtype and shape: a floating result of a wider dtype (``k`` a
    float32 tensor, ``t`` bf16) is rounded once to ``t``'s dtype; an integer ``t`` whose result
    is not an integer, or a ``k`` that broadcasts ``t`` to a larger shape, is refused."""
    if isinstance(k, torch.Tensor):
        k = k.to(t.device)
    elif not t.is_floating_point() and not t.is_complex() and isinstance(k, float):
        if not k.is_integer():
            raise _OpError(
                f"{op!r} would turn this {t.dtype} tensor into a float one; give an integer, "
                "or edit with a function that says which dtype you want"
            )
        k = int(k)
    new = fn(t, k)
    if new.shape != t.shape:
        raise _OpError(
            f"{op!r}: its tensor of shape {tuple(k.shape)} broadcasts this value of shape "
            f"{tuple(t.shape)} to {tuple(new.shape)}; give one that broadcasts to {tuple(t.shape)}"
        )
    if new.dtype != t.dtype:
        if not (t.is_floating_point() and new.is_floating_point()):
            raise _OpError(
                f"{op!r} would turn this {t.dtype} tensor into {new.dtype}; "
                f"give a tensor the {t.dtype} values can keep (e.g. .to({t.dtype}))"
            )
        new = new.to(t.dtype)  # (computed in the wider dtype, rounded once)
    return new


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
        lo, hi = self.min, self.max
        if not t.is_floating_point() and t.dtype != torch.bool:
            # an integer is >= 1.5 exactly when it is >= 2: the bounds made integers keep the dtype
            lo = math.ceil(lo) if isinstance(lo, float) else lo
            hi = math.floor(hi) if isinstance(hi, float) else hi
            if lo is not None and hi is not None and lo > hi:
                raise _OpError(
                    f"{self!r}: no integer lies in [{self.min}, {self.max}], so this {t.dtype} "
                    "tensor cannot be clamped into it"
                )
        return t.clamp(min=lo, max=hi)


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
            if not t.is_floating_point() and not t.is_complex() and not float(v).is_integer():
                raise _OpError(
                    f"{self!r}: this tensor is {t.dtype}, which cannot hold {v} (it would be "
                    "truncated); give an integer"
                )
            return torch.full_like(t, v)
        if not torch.can_cast(v.dtype, t.dtype):
            raise _OpError(
                f"{self!r}: the replacement is {v.dtype}, and this tensor is {t.dtype}, which "
                f"cannot hold its values exactly (truncated); give a {t.dtype} tensor"
            )
        if v.shape != t.shape:
            try:
                fits = torch.broadcast_shapes(v.shape, t.shape) == t.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise _OpError(
                    f"replace: the replacement has shape {tuple(v.shape)}, which does not "
                    f"broadcast to the value's shape {tuple(t.shape)}"
                )
        # a new tensor each call, in the value's dtype (rounded as .to() rounds) and layout: the
        # replacement itself, handed to the model, would be changed by the model's in-place ops
        # (`out += x`, ReLU(inplace=True)), and the next call would read the changed one
        if t.__class__ is torch.Tensor:
            return torch.empty_like(t).copy_(v)
        # (a DTensor: a full plain tensor, which edit_grads lays out as the gradient's shards)
        return v.to(device=t.device, dtype=t.dtype).expand(t.shape).clone()


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
    _public = "clip_norm"  # type: ignore[assignment]

    def __init__(self, max_norm: float, eps: float = 1e-6) -> None:
        _number(max_norm, "hs.ops.clip_norm: max_norm", tensor=False)
        if max_norm <= 0:
            raise ValueError(f"hs.ops.clip_norm: max_norm must be > 0, got {max_norm}")
        self.max_norm, self._eps = max_norm, eps

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            raise _OpError(
                f"{self!r}: this tensor is {t.dtype}; a factor below 1 cast to it would be 0 "
                "(clip_norm rescales floating tensors only)"
            )
        norm = torch.linalg.vector_norm(t.float())
        factor = (self.max_norm / (norm + self._eps)).clamp(max=1.0)
        return t * factor  # (a 0-dim float32 factor: the result keeps t's dtype)


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
        try:
            return fn(value) if isinstance(value, torch.Tensor) else map_tensors(fn, value)
        except _OpError as e:
            raise _OpError(f"{what}: {e}{_nested_hint(value)}") from None
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


def _nested_hint(value: Any) -> str:
    """For an op refused on a tensor inside a nested value: which tensors the op acts on."""
    if isinstance(value, torch.Tensor):
        return ""
    from ._nested import iter_tensors

    kinds = ", ".join(
        f"{'.'.join(map(str, p)) or '.'}: {t.dtype} {tuple(t.shape)}"
        for p, t in iter_tensors(value)
    )
    return (
        f" (an op acts on every tensor of a nested value; this one holds {kinds}: to edit one "
        "item, give a function, e.g. lambda out: (out[0] * 2, *out[1:]))"
    )


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
