"""Tolerances from the two dtypes: how much two correct computations of one module may differ.

A module's output computed in a dtype ``d`` carries a relative rounding error of about ``eps(d)``
(the output is rounded once), plus what its reductions accumulate in float32 (bf16 and fp16
matmuls accumulate in float32): about ``eps(float32) * sqrt(K)`` for a reduction over ``K``
terms. The tolerance for one module is a multiple of both::

    tol = 4 * eps(lower dtype) + 16 * eps(float32) * sqrt(K)

where the lower dtype is the less precise of the two runs' dtypes (the autocast dtype where a run
uses autocast) and ``K`` is the module's largest reduction, estimated as the largest of the last
dimension of its floating inputs and the fan-in (``numel / shape[0]``) of its own parameters.
Figures: fp32 pairs with ``K = 64``: 1.6e-5 (fp32 eager against an fp32 copy differs by exactly
0, inductor by <= 5e-7 per module); bf16 pairs: 3.1e-2 (fault-free bf16 modules differ by
<= 1.3e-2), below the 5e-2 change that must be named.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core._nested import continuous, iter_tensors, real_parts

__all__ = [
    "Lazy",
    "Norms",
    "float_error",
    "has_integers",
    "lower",
    "reduction_size",
    "rel_error",
    "rel_pairs",
    "tolerance",
    "value",
    "worst",
]

_EPS32 = torch.finfo(torch.float32).eps


def lower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (larger machine epsilon).

    >>> lower(torch.float32, torch.bfloat16)
    torch.bfloat16
    """
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def tolerance(dtype: torch.dtype, k: int) -> float:
    """``4 * eps(dtype) + 16 * eps(float32) * sqrt(k)`` (see the module docstring).

    >>> round(tolerance(torch.bfloat16, 64), 4), f"{tolerance(torch.float32, 64):.1e}"
    (0.0313, '1.6e-05')
    """
    eps = torch.finfo(dtype).eps
    return 4 * eps + 16 * _EPS32 * math.sqrt(max(1, k))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided real tensor with the same norm: a complex one as its real and imaginary
    parts (``view_as_real``: ``||z||^2 = sum(re^2 + im^2)``), a sparse one dense, a quantized one
    dequantized (its values as the model reads them)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    return real_parts(t)


def reduction_size(inputs: Any, params: Any) -> int:
    """The largest reduction a module likely does: last dimension of its floating inputs, fan-in of
    its own parameters."""
    k = 1
    for _, t in iter_tensors(inputs):
        if continuous(t) and t.ndim:
            k = max(k, t.shape[-1])
    for p in params:
        if p.ndim > 1 and p.shape[0]:
            k = max(k, p.numel() // p.shape[0])
    return k


def rel_error(ref: Any, got: Any) -> float | None:
    """Norm-wise relative error of ``got`` against ``ref`` over their floating tensors (paired in
    order; norms in float32, in float64 where a tensor is not finite or is float64): ``||got - ref|| / ||ref||``. ``0.0`` when equal, ``inf`` when the
    structures or shapes differ or ``got`` is not finite where ``ref`` is; ``None`` when there is
    nothing to compare.

    >>> rel_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))
    0.1
    """
    norms = Norms()
    err = norms.rel_error(ref, got)
    norms.resolve()
    return value(err)


def float_error(ref: Any, got: Any) -> float | None:
    """:func:`rel_error` over the pairs of floating tensors only (integer ones left out, even
    where they differ); ``None`` when there is none or the structures differ. What a module's
    floating outputs say where its integer outputs (a router's expert indices) differ.

    >>> float_error((torch.tensor([3.0, 4.0]), torch.tensor([1])),
    ...             (torch.tensor([3.0, 4.5]), torch.tensor([2])))
    0.1
    """
    a = [t for _, t in iter_tensors(ref)]
    b = [t for _, t in iter_tensors(got)]
    if len(a) != len(b):
        return None
    pairs = [(x, y) for x, y in zip(a, b) if continuous(x) and continuous(y)]
    return rel_pairs(pairs) if pairs else None


def narrowed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` for a floating ``t``, finite values beyond ``dtype``'s range saturated at
    its largest (a plain cast overflows them to infinity: Transformers' attention mask, filled
    with float32's minimum, became -inf in bfloat16, and fully masked rows softmaxed to NaN);
    infinities and NaNs stay as they are.

    >>> narrowed(torch.tensor([torch.finfo(torch.float32).min, -1.0]), torch.bfloat16).isinf().any()
    tensor(False)
    """
    if t.dtype == dtype or not dtype.is_floating_point or not t.is_floating_point():
        return t.to(dtype)
    top = torch.finfo(dtype).max
    if torch.finfo(t.dtype).max <= top or not t.numel():
        return t.to(dtype)
    lo, hi = torch.aminmax(t.detach())  # (one pass; a NaN compares False: kept as it is)
    if not (lo.item() < -top or hi.item() > top):
        return t.to(dtype)
    clamped = t.clamp(-top, top)
    return torch.where(torch.isfinite(t), clamped, t).to(dtype)


_NUMBERS = (int, float, bool)


def _numbers(obj: Any, out: list[Any], depth: int = 8) -> None:
    """The Python numbers in ``obj`` (through tuples, lists and dicts), in order."""
    if obj.__class__ in _NUMBERS:
        out.append(obj)
    elif depth and isinstance(obj, (tuple, list)):
        for x in obj:
            _numbers(x, out, depth - 1)
    elif depth and isinstance(obj, dict):
        for x in obj.values():
            _numbers(x, out, depth - 1)


def _number_error(ref: Any, got: Any) -> float | None:
    """The worst error among the Python numbers of two values (``None``: there are none)."""
    if ref.__class__ is torch.Tensor:
        return None
    a: list[Any] = []
    b: list[Any] = []
    _numbers(ref, a)
    _numbers(got, b)
    if not a and not b:
        return None
    if len(a) != len(b):
        return math.inf
    err = 0.0
    for x, y in zip(a, b):
        if x == y or (x != x and y != y):  # (a NaN is the same NaN)
            continue
        if isinstance(x, float) or isinstance(y, float):
            if x == 0 or not math.isfinite(x) or not math.isfinite(y):
                return math.inf
            err = max(err, abs(y - x) / abs(x))
        else:
            return math.inf
    return err


def has_integers(value: Any) -> bool:
    """Whether ``value`` holds a tensor that is not floating (ids, indices, a mask), or a Python
    int or bool (``int(x.argmax())``)."""
    if any(not continuous(t) for _, t in iter_tensors(value)):
        return True
    nums: list[Any] = []
    _numbers(value, nums)
    return any(not isinstance(n, float) for n in nums)


def int_numbers(value: Any) -> list[Any]:
    """The Python ints and bools in ``value``, in order."""
    nums: list[Any] = []
    _numbers(value, nums)
    return [n for n in nums if not isinstance(n, float)]


_PROMOTE = (torch.float32, torch.bfloat16, torch.float16)
# dtypes whose values are compared through :func:`_plain` (complex as real pairs, quantized as
# their values)
_OTHER = frozenset(
    {torch.complex32, torch.complex64, torch.complex128, torch.qint8, torch.quint8, torch.qint32,
     torch.quint4x2, torch.quint2x4}
)  # fmt: skip


def _fast(
    x: torch.Tensor, y: torch.Tensor, seen: dict[Any, float] | None = None
) -> tuple[float, float] | None:
    """Squared norms of ``y - x`` and ``x`` in float32, when both are finite (the common case;
    equal tensors still give exactly 0); ``None`` sends the pair down the careful path.
    ``seen``: the norms of the ``x`` already computed, by the memory they read (one recorded
    value is the reference of several pairs: a call's output, its replay's and its caller's
    input), for pairs whose tensors all stay alive and unchanged meanwhile (:meth:`Norms.resolve`)."""
    if x.dtype == torch.float64 or y.dtype == torch.float64:
        return None
    xf = x.detach()
    if xf.dtype != torch.float32:
        xf = xf.float()
    yd = y.detach()
    if yd.device != xf.device:
        yd = yd.to(xf.device)
    if yd.dtype not in _PROMOTE:
        yd = yd.float()
    # bf16/fp16 minus float32 computes in float32 (type promotion): no float32 copy of y first
    d = float(torch.linalg.vector_norm(yd - xf))
    if seen is None:
        n = float(torch.linalg.vector_norm(xf))
    else:
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
        n = seen.get(key)  # type: ignore[assignment]
        if n is None:
            n = seen[key] = float(torch.linalg.vector_norm(xf))
    if math.isfinite(d) and math.isfinite(n):
        return d * d, n * n
    return None


# pairs of at most this many elements are stacked with the pairs of their size and dtypes: one
# subtraction and two norms per group instead of per pair (a tiny model's rows have hundreds of
# small pairs of a dozen shapes: the norms of the fault suite's Llama and ViT about 40% faster);
# larger ones one at a time (a stack of large pairs is a large fresh allocation: measured 2.5x
# slower than pair by pair on the CNN with a limit of 65536)
_GROUP = 1 << 12


def _fast_many(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[tuple[float, float] | None]:
    """:func:`_fast` of pairs of one size and dtypes, stacked (``None`` for a pair whose norms
    are not finite: the careful path)."""
    x = torch.stack([t.reshape(-1) for t in xs])  # detached when added (Norms._add)
    if x.dtype != torch.float32:
        x = x.float()
    y = torch.stack([t.reshape(-1) for t in ys])
    if y.device != x.device:
        y = y.to(x.device)
    if y.dtype not in _PROMOTE:
        y = y.float()
    d = torch.linalg.vector_norm(y - x, dim=1).tolist()
    n = torch.linalg.vector_norm(x, dim=1).tolist()
    return [(a * a, b * b) if math.isfinite(a) and math.isfinite(b) else None for a, b in zip(d, n)]


def _careful(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Squared norms of ``y - x`` and ``x`` in float64, where a value is not finite or beyond
    ``y``'s range; ``(inf, 0)`` when the two cannot agree (another non-finite pattern)."""
    xd = x.detach().to(torch.float64)
    yd = y.detach().to(device=xd.device, dtype=torch.float64)
    top = torch.finfo(y.dtype).max
    if top < torch.finfo(x.dtype).max:  # beyond y's range (an fp32 mask's minimum in bf16)
        over = xd.abs() > top
        if bool(over.any()):
            # y overflowed to inf, or saturated at its own extreme: the same value there
            same = (yd[over].abs() >= top) & (yd[over].sign() == xd[over].sign())
            if not bool(same.all()):
                return math.inf, 0.0
            xd, yd = xd[~over], yd[~over]
    finite = torch.isfinite(xd)
    if not bool(finite.all()):  # the non-finite pattern must agree; then the finite part
        if not torch.equal(torch.isfinite(yd), finite) or not torch.equal(
            xd[~finite].nan_to_num(), yd[~finite].nan_to_num()
        ):
            return math.inf, 0.0
        xd, yd = xd[finite], yd[finite]
    d = float(torch.linalg.vector_norm(yd - xd))
    if math.isnan(d):
        return math.inf, 0.0
    return d * d, float(torch.linalg.vector_norm(xd)) ** 2


def _screen(x: torch.Tensor, y: torch.Tensor) -> bool | None:
    """The checks every pair passes before its norms: ``None`` when ``x`` is not floating and
    the two are equal (nothing to add), ``False`` when they cannot agree (other shapes, other
    integers), ``True`` when its norms are to be computed."""
    if not x.is_floating_point():  # integers (ids, positions) must agree exactly
        if x.shape != y.shape or not torch.equal(x, y.to(x.device, x.dtype)):
            return False
        return None
    return x.shape == y.shape


def _ratio(num: float, den: float) -> float:
    if math.isinf(num):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def rel_pairs(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> float | None:
    """:func:`rel_error` over explicit ``(ref, got)`` pairs; pairs with a ``None`` are skipped
    (:meth:`Norms.rel_pairs`, computed at once)."""
    norms = Norms()
    got = norms.rel_pairs(pairs)
    norms.resolve()
    return value(got)


class Lazy:
    """A relative error computed later, with others (:class:`Norms`); ``get()`` gives it."""

    __slots__ = ("_done", "_fn", "_value")

    def __init__(self, fn: Any) -> None:
        self._fn, self._done, self._value = fn, False, None

    def get(self) -> float | None:
        if not self._done:
            self._value, self._done, self._fn = self._fn(), True, None
        return self._value


def value(e: Any) -> float | None:
    """A :class:`Lazy` error's value; a plain float or ``None`` as it is."""
    return e.get() if isinstance(e, Lazy) else e


def worst(errors: list[Any]) -> Lazy:
    """The largest of some errors (lazy ones included), ``None`` when none is known."""

    def fn() -> float | None:
        known = [v for v in (value(e) for e in errors) if v is not None]
        return max(known) if known else None

    return Lazy(fn)


class Norms:
    """:func:`rel_pairs` for many pairs, computed later: each call returns a :class:`Lazy` error
    and :meth:`resolve` computes the norms of all pending pairs (small pairs stacked with those
    of their size, :func:`_fast_many`; large ones one at a time: measured faster here than
    ``torch._foreach_norm`` or one ``segment_reduce`` over all of them, on the fault suite's
    models). So the rows are made first and their verdicts after, and the tensors
    held until then are bounded: at most ``budget`` bytes (then it resolves by itself), so what
    :func:`hookscope.compare` reads back from disk does not pile up."""

    def __init__(self, budget: int = 64 << 20) -> None:
        self.budget = budget
        self._x: list[torch.Tensor] = []
        self._y: list[torch.Tensor] = []
        self._bytes = 0
        self._parts: list[tuple[float, float]] = []  # squared norms of each pair, once resolved
        self._base = 0  # index of the first pending pair

    def rel_pairs(
        self,
        pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]],
        missing: bool = False,
    ) -> Any:
        """Like :func:`rel_pairs`: ``inf`` or ``None`` at once, else a :class:`Lazy`.
        ``missing``: a tensor on one side only is compared with zeros (a gradient that one run
        has and the other has not: no gradient flowed there), not skipped."""
        idx: list[int] = []
        for x, y in pairs:
            if missing and (x is None) != (y is None):
                x = torch.zeros_like(y) if x is None else x
                y = torch.zeros_like(x) if y is None else y
            if x is None or y is None:
                continue
            if (
                x.dtype in _OTHER
                or y.dtype in _OTHER
                or x.layout != torch.strided
                or y.layout != torch.strided
            ):
                x, y = _plain(x), _plain(y)
            ok = _screen(x, y)
            if ok is None:
                continue
            if not ok:
                return math.inf
            idx.append(self._add(x, y))
        if not idx:
            return None
        parts = self._parts

        def fn() -> float | None:
            num = sum(parts[i][0] for i in idx)
            den = sum(parts[i][1] for i in idx)
            return _ratio(num, den)

        if self._bytes > self.budget:
            self.resolve()
        return Lazy(fn)

    def rel_error(self, ref: Any, got: Any) -> Any:
        """Like :func:`rel_error`, lazily; Python numbers among the values (a module returning
        ``int(x.shape[-1] // k)``, a float) are compared too: relatively for floats, exactly
        for ints and bools (``inf`` where they differ)."""
        if ref.__class__ is torch.Tensor and got.__class__ is torch.Tensor:
            return self.rel_pairs([(ref, got)])
        a = [t for _, t in iter_tensors(ref)]
        b = [t for _, t in iter_tensors(got)]
        if len(a) != len(b):
            return math.inf
        nums = _number_error(ref, got)
        if nums is None:
            return self.rel_pairs(list(zip(a, b)))
        if not a:
            return nums
        return worst([self.rel_pairs(list(zip(a, b))), nums])

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> int:
        self._x.append(x.detach() if x.requires_grad else x)
        self._y.append(y.detach() if y.requires_grad else y)
        self._bytes += x.numel() * x.element_size() + y.numel() * y.element_size()
        return self._base + len(self._x) - 1

    def resolve(self) -> None:
        """Compute the norms of every pending pair (and drop the tensors)."""
        xs, ys = self._x, self._y
        if not xs:
            return
        self._x, self._y, self._bytes = [], [], 0
        self._base += len(xs)
        parts: list[tuple[float, float] | None] = [None] * len(xs)
        groups: dict[tuple[Any, ...], list[int]] = {}
        seen: dict[Any, float] = {}  # (every pending tensor is alive until this ends)
        for i, (x, y) in enumerate(zip(xs, ys)):
            n = x.numel()
            if n <= _GROUP and x.dtype != torch.float64 and y.dtype != torch.float64:
                groups.setdefault((n, x.dtype, y.dtype, x.device, y.device), []).append(i)
            else:
                parts[i] = _fast(x, y, seen) or _careful(x, y)
        for idx in groups.values():
            if len(idx) == 1:
                i = idx[0]
                parts[i] = _fast(xs[i], ys[i]) or _careful(xs[i], ys[i])
                continue
            for i, got in zip(idx, _fast_many([xs[i] for i in idx], [ys[i] for i in idx])):
                parts[i] = got or _careful(xs[i], ys[i])
        self._parts.extend(parts)  # type: ignore[arg-type]
