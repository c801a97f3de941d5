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

from ..core._nested import iter_tensors

__all__ = ["lower", "reduction_size", "rel_error", "rel_pairs", "tolerance"]

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


def reduction_size(inputs: Any, params: Any) -> int:
    """The largest reduction a module likely does: last dimension of its floating inputs, fan-in of
    its own parameters."""
    k = 1
    for _, t in iter_tensors(inputs):
        if t.is_floating_point() and t.ndim:
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
    a = [t for _, t in iter_tensors(ref)]
    b = [t for _, t in iter_tensors(got)]
    if len(a) != len(b):
        return math.inf
    return rel_pairs(list(zip(a, b)))


def _fast(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float] | None:
    """Squared norms of ``y - x`` and ``x`` in float32, when both are finite (the common case;
    equal tensors still give exactly 0); ``None`` sends the pair down the careful path."""
    if x.dtype == torch.float64 or y.dtype == torch.float64:
        return None
    xf = x.detach().float()
    yf = y.detach().to(device=xf.device, dtype=torch.float32)
    d = float(torch.linalg.vector_norm(yf - xf))
    n = float(torch.linalg.vector_norm(xf))
    if math.isfinite(d) and math.isfinite(n):
        return d * d, n * n
    return None


def rel_pairs(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> float | None:
    """:func:`rel_error` over explicit ``(ref, got)`` pairs; pairs with a ``None`` are skipped."""
    num = den = 0.0
    seen = False
    for x, y in pairs:
        if x is None or y is None:
            continue
        if not x.is_floating_point():  # integers (ids, positions) must agree exactly
            if x.shape != y.shape or not torch.equal(x, y.to(x.device, x.dtype)):
                return math.inf
            continue
        if x.shape != y.shape:
            return math.inf
        seen = True
        fast = _fast(x, y)
        if fast is not None:
            num, den = num + fast[0], den + fast[1]
            continue
        xd = x.detach().to(torch.float64)
        yd = y.detach().to(device=xd.device, dtype=torch.float64)
        top = torch.finfo(y.dtype).max
        if top < torch.finfo(x.dtype).max:  # beyond y's range (an fp32 mask's minimum in bf16)
            over = xd.abs() > top
            if bool(over.any()):
                # y overflowed to inf, or saturated at its own extreme: the same value there
                same = (yd[over].abs() >= top) & (yd[over].sign() == xd[over].sign())
                if not bool(same.all()):
                    return math.inf
                xd, yd = xd[~over], yd[~over]
        finite = torch.isfinite(xd)
        if not bool(finite.all()):  # the non-finite pattern must agree; then the finite part
            if not torch.equal(torch.isfinite(yd), finite) or not torch.equal(
                xd[~finite].nan_to_num(), yd[~finite].nan_to_num()
            ):
                return math.inf
            xd, yd = xd[finite], yd[finite]
        d = float(torch.linalg.vector_norm(yd - xd))
        if math.isnan(d):
            return math.inf
        num += d * d
        den += float(torch.linalg.vector_norm(xd)) ** 2
    if not seen:
        return None
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)
