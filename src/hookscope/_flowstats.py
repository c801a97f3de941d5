"""Training statistics computed on the device, and their exact combination across ranks.

Everything here runs without a host sync: hooks produce small fp32/int64 vectors, the monitor
concatenates them once per logged step and reads them with one transfer. Counts stay int64 until
that transfer (exact for any tensor size); means and standard deviations of several ranks are
combined exactly from ``(n, mean, std)`` (Chan et al.), not by averaging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

__all__ = [
    "Scratch",
    "absmax_of",
    "act_stats",
    "combine_acts",
    "combine_grads",
    "grad_stats",
    "param_stats",
    "saturation_bounds",
]

_INF = float("inf")

# output types whose values saturate at known bounds -> (low, high)
_BOUNDED: dict[type, tuple[float, float]] = {
    nn.Tanh: (-1.0, 1.0),
    nn.Softsign: (-1.0, 1.0),
    nn.Sigmoid: (0.0, 1.0),
    nn.Hardsigmoid: (0.0, 1.0),
}


def saturation_bounds(module: nn.Module) -> tuple[float, float] | None:
    """``(low, high)`` for a saturating activation (Tanh, Sigmoid, Hardtanh, ...), else ``None``."""
    if isinstance(module, nn.Hardtanh):
        return float(module.min_val), float(module.max_val)
    for cls, bounds in _BOUNDED.items():
        if isinstance(module, cls):
            return bounds
    return None


class Scratch:
    """A reusable flat buffer for elementwise temporaries (allocating a fresh multi-MB tensor per
    hook call costs more than the arithmetic on CPU)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def like(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buf
        if b is None or b.numel() < x.numel() or b.dtype != x.dtype or b.device != x.device:
            b = self._buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        return b[: x.numel()].view(x.shape)


_EXACT_F32 = 2**24  # counts summed in fp32 are exact below this


def act_stats(
    x: torch.Tensor,
    bounds: tuple[float, float] | None,
    margin: float,
    bins: int,
    scratch: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Statistics of one activation, as a float64 vector
    ``[mean, std, absmax, nonzero count, finite count(, saturated count)]`` on ``x``'s device, and a
    histogram of ``x / absmax`` over ``[-1, 1]`` in ``bins`` bins when ``bins > 0``.

    On CUDA this is a handful of reductions, read later with the other statistics. On CPU the
    values already live on the host, so reading a scalar is no device sync: the common case uses
    only the fastest CPU reductions (sum, 2-norm, min/max) and falls back to exact slower ones when
    a value is non-finite or the one-pass variance could lose precision.
    """
    x = x.detach()
    n = x.numel()
    if n == 0:
        return torch.full((5 if bounds is None else 6,), math.nan, dtype=torch.float64), None
    if x.device.type == "cpu":
        vec = _act_stats_cpu(x, n, scratch or Scratch())
    else:
        x32 = x.float()
        mean = x32.mean()  # not std_mean: its mean is NaN, not inf, when an element is infinite
        std = x32.std() if n > 1 else torch.full((), math.nan, device=x.device)
        mn, mx = torch.aminmax(x32)
        vec = torch.stack(
            [
                mean.double(),
                std.double(),
                torch.maximum(mn.abs(), mx.abs()).double(),
                torch.count_nonzero(x32).double(),
                torch.count_nonzero(torch.isfinite(x32)).double(),
            ]
        )
    if bounds is not None:
        lo, hi = bounds
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        sat = (
            torch.count_nonzero((x.float() - mid).abs() >= half * (1 - 2 * margin))
            .double()
            .reshape(1)
        )
        vec = torch.cat([vec, sat.to(vec.device)])
    hist = None
    if bins > 0:
        x32 = x.float()
        absmax = vec[2].float().clamp_min(1e-30).to(x.device)
        y = torch.where(torch.isfinite(x32), x32, 0.0) / absmax
        hist = torch.histc(y, bins=bins, min=-1.0, max=1.0).double()
    return vec, hist


def _act_stats_cpu(x: torch.Tensor, n: int, scratch: Scratch) -> torch.Tensor:
    x = x if x.dtype == torch.float32 else x.float()
    s = float(x.sum())  # cascade summation: as precise as torch.mean
    mn, mx = (float(v) for v in torch.aminmax(x))
    absmax = max(abs(mn), abs(mx)) if not (math.isnan(mn) or math.isnan(mx)) else math.nan
    if not (math.isfinite(s) and math.isfinite(absmax)):  # non-finite values: exact, slower path
        mean = float(x.mean())
        std = float(x.std()) if n > 1 else math.nan
        nonzero = float(torch.count_nonzero(x))
        finite = float(torch.count_nonzero(torch.isfinite(x)))
        return torch.tensor([mean, std, absmax, nonzero, finite], dtype=torch.float64)
    mean = s / n
    std = math.nan
    if n > 1:
        # sums use cascade summation (as torch.mean/std do, ~1e-8 relative; BLAS dot and the
        # fp32 2-norm lose ~1e-6). One pass, sum(x*x), when the mean is small against the
        # spread (cancellation below 1e-7), else two passes: sum((x - mean)^2).
        q = float(torch.mul(x, x, out=scratch.like(x)).sum())
        var = (q - n * mean * mean) / (n - 1)
        if not (var > 0 and q <= 4.0 * n * var):
            var = float(torch.sub(x, mean, out=scratch.like(x)).square_().sum()) / (n - 1)
        std = math.sqrt(var)
    if n > _EXACT_F32:
        nonzero = float(torch.count_nonzero(x))
    else:
        buf = torch.sign(x, out=scratch.like(x))  # sum |sign(x)| = nonzero count
        nonzero = float(buf.abs_().sum())
    return torch.tensor([mean, std, absmax, nonzero, float(n)], dtype=torch.float64)


def grad_stats(g: torch.Tensor) -> torch.Tensor:
    """``[norm, min, max]`` of a gradient (float64 vector; ``absmax = max(|min|, |max|)``)."""
    g = g.detach()
    mn, mx = torch.aminmax(g)
    return torch.stack(
        [torch.linalg.vector_norm(g, 2, dtype=torch.float32), mn.float(), mx.float()]
    ).double()


def param_stats(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    before: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Rows ``[grad_norm, weight_norm, update_norm, before_norm]`` per parameter (float64), with
    foreach ops; missing values are NaN (a parameter without a gradient gets no grad statistics,
    never a fake zero). ``before`` (a snapshot owned by the caller) is overwritten."""
    n = len(weights)
    dev = weights[0].device
    nan = torch.full((n,), math.nan, device=dev)
    w = [p.detach() for p in weights]
    cols = [nan, torch.stack(torch._foreach_norm(w, 2, dtype=torch.float32)), nan, nan]
    have = [i for i, g in enumerate(grads) if g is not None]
    if have:
        gs = [grads[i].detach() for i in have]  # type: ignore[union-attr]
        idx = torch.tensor(have, device=dev)
        cols[0] = nan.index_put(
            (idx,), torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32))
        )
    if before is not None:
        cols[3] = torch.stack(torch._foreach_norm(before, 2, dtype=torch.float32))
        torch._foreach_sub_(before, w)  # in place: no second parameter-sized allocation
        cols[2] = torch.stack(torch._foreach_norm(before, 2, dtype=torch.float32))
    return torch.stack(cols, dim=1).double()


def combine_acts(n: Sequence[float], v: Sequence[Sequence[float]]) -> dict[str, float]:
    """Combine per-rank element counts ``n`` and :func:`act_stats` vectors into one entry."""
    total = sum(n)
    if len(n) == 1:  # one rank: the values as computed, no arithmetic on them
        mean, std, absmax = v[0][0], v[0][1], v[0][2]
    else:
        mean = sum(nr * r[0] for nr, r in zip(n, v)) / total
        m2 = 0.0
        for nr, r in zip(n, v):
            if nr > 1:
                m2 += r[1] ** 2 * (nr - 1)
            m2 += nr * (r[0] - mean) ** 2
        std = math.sqrt(m2 / (total - 1)) if total > 1 else math.nan
        absmax = math.nan if any(math.isnan(r[2]) for r in v) else max(r[2] for r in v)
    out = {
        "mean": mean,
        "std": std,
        "absmax": absmax,
        "zeros": (total - sum(r[3] for r in v)) / total,
        "nonfinite": total - sum(r[4] for r in v),
    }
    if len(v[0]) > 5:
        out["saturated"] = sum(r[5] for r in v) / total
    return out


def absmax_of(mn: float, mx: float) -> float:
    """``max |x|`` from min and max (NaN if either is NaN)."""
    return math.nan if math.isnan(mn) or math.isnan(mx) else max(abs(mn), abs(mx))


def combine_grads(g: Sequence[Sequence[float]], scale: float) -> dict[str, float]:
    """Combine per-rank ``[norm, min, max]`` of an output gradient (norm of the concatenation)."""
    norm = (g[0][0] if len(g) == 1 else math.sqrt(sum(r[0] ** 2 for r in g))) / scale
    ams = [absmax_of(r[1], r[2]) for r in g]
    absmax = (math.nan if any(math.isnan(a) for a in ams) else max(ams)) / scale
    return {"grad_norm": norm, "grad_absmax": absmax}
