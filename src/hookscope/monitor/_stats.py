"""Training statistics computed on the device, and their exact combination across ranks.

Everything here runs without a host sync: hooks produce small fp32/int64 vectors, the monitor
concatenates them once per logged step and reads them with one transfer. Counts stay int64 until
that transfer (exact for any tensor size); means and standard deviations of several ranks are
combined exactly from ``(n, mean, std)`` (Chan et al.), not by averaging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch
import torch.nn as nn

__all__ = [
    "Scratch",
    "Vec",
    "absmax_of",
    "act_stats",
    "combine_acts",
    "combine_grads",
    "cpu_norm",
    "grad_stats",
    "histogram",
    "minmax",
    "param_stats",
    "ranks_absmax",
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
    """Reusable block-sized NumPy buffers for elementwise temporaries (allocating a fresh array
    per hook call costs more than the arithmetic on CPU): a bool mask and an fp32 buffer."""

    def __init__(self) -> None:
        self._mask: np.ndarray | None = None
        self._floats: np.ndarray | None = None

    def mask(self, n: int) -> np.ndarray:
        m = self._mask
        if m is None or m.shape[0] < n:
            m = self._mask = np.empty(n, dtype=bool)
        return m[:n]

    def floats(self, n: int) -> np.ndarray:
        f = self._floats
        if f is None or f.shape[0] < n:
            f = self._floats = np.empty(n, dtype=np.float32)
        return f[:n]


Vec = Union[torch.Tensor, list]  # noqa: UP007
"""A statistics vector: a float64 tensor on a CUDA device (read later, with the others, in one
transfer), or a list of floats computed on the host."""

_BLOCK = 1 << 16
"""Statistics are taken over blocks of this many fp32 values (256 KiB, well inside L2): the first
reduction of a block brings it into cache and the others read it there. Measured on resnet18's
activations at 224x224 (120 M values), 1 thread: 256 KiB blocks take 0.78x the time of 1 MiB
blocks, 1.4x less than whole-tensor passes. A BLAS dot product of this length in fp32 is
accurate to ~1e-7; block results are added in fp64."""


def _blocks(n: int, size: int = _BLOCK) -> range:
    """Offsets of ``size``-long blocks of ``n`` values, last first: the layer that just wrote the
    tensor left its end in cache."""
    return range((n - 1) // size * size, -1, -size) if n else range(0)


def _sumsq(a: np.ndarray) -> float:
    """``sum(a * a)`` of a 1-D float32 array, one read: BLAS dots over blocks, added in fp64 (one
    fp32 dot over millions of elements, or torch's fp32 2-norm, loses 1e-5 to 1e-3). NaN and
    infinities propagate."""
    dot, q = np.dot, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i in _blocks(a.shape[0]):
            c = a[i : i + _BLOCK]
            v = float(dot(c, c))
            if (not math.isfinite(v) and bool(np.isfinite(c).all())) or (v < _TINY and c.any()):
                v = _wide_sumsq(c)  # finite values whose fp32 squares overflow or underflow
            q += v
    return q


def _wide_sumsq(c: np.ndarray) -> float:
    """``sum(c * c)`` of finite values in float64 (where the fp32 dot overflowed, values near
    1e19 and beyond, or underflowed, all below ~1e-15; float64 holds their squares)."""
    w = c.astype(np.float64)
    return float(np.dot(w, w))


_ONES = np.ones(_BLOCK, dtype=np.float32)
# a block's fp32 sum of squares below this: its values all below ~1e-15, whose squares lose
# bits in fp32 (subnormal below ~1e-19, 0 below ~1e-23): summed in float64 instead
_TINY = 2.0**-100
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # NaN if any NaN; bound: called per block


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as a 1-D contiguous tensor, without a copy when ``x`` is dense in any
    memory format (channels-last, transposed): these statistics do not depend on the order."""
    if x.is_contiguous():
        return x.view(-1)
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    y = x.permute(order)
    # not reshape(-1): it returns a strided view when it can (an expanded tensor's stride-0 view),
    # and the blocked NumPy reductions below want one dense run
    return y.view(-1) if y.is_contiguous() else y.contiguous().view(-1)


def _host_array(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as a 1-D float32 NumPy array (a view when it is float32)."""
    x = _flat(x.detach())
    if x.dtype != torch.float32:
        x = x.float()
    return x.resolve_neg().resolve_conj().numpy()


def cpu_norm(t: torch.Tensor) -> float:
    """Accurate 2-norm of a CPU tensor (see :func:`_sumsq`); NaN/inf propagate."""
    return math.sqrt(_sumsq(_host_array(t)))


def act_stats(
    x: torch.Tensor,
    bounds: tuple[float, float] | None,
    margin: float,
    bins: int,
    scratch: Scratch | None = None,
) -> tuple[Vec, torch.Tensor | None]:
    """Statistics of one activation, as a vector
    ``[mean, std, absmax, nonzero count, finite count(, saturated count)]`` (a float64 tensor on
    ``x``'s CUDA device, or a list of floats for a CPU tensor: already on the host, no tensor needed),
    and a histogram of ``x / absmax`` over ``[-1, 1]`` in ``bins`` bins when ``bins > 0``.

    On CUDA this is a handful of reductions, read later with the other statistics. On CPU the
    values already live on the host, so reading a scalar is no device sync: the common case is
    the fastest NumPy reductions (min, max, BLAS dots and a bool count, 2-6x faster here than torch's sum, aminmax,
    comparisons and count_nonzero); it falls back to exact slower ones when a value is
    non-finite or the one-pass variance could lose precision.
    """
    x = x.detach()
    n = x.numel()
    vec: Vec
    if n == 0:
        return [math.nan] * (5 if bounds is None else 6), None
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
        sat = torch.count_nonzero((x.float() - mid).abs() >= half * (1 - 2 * margin))
        if isinstance(vec, list):
            vec.append(float(sat))
        else:
            vec = torch.cat([vec, sat.double().reshape(1)])
    hist = histogram(x, vec[2], bins) if bins > 0 else None
    return vec, hist


def histogram(x: torch.Tensor, absmax: float | torch.Tensor, bins: int) -> torch.Tensor:
    """Counts of ``x / absmax`` over ``[-1, 1]`` in ``bins`` bins (non-finite values counted as
    0), float64. Each value's bin depends on that value and ``absmax`` only, so the counts of
    several tensors binned with one ``absmax`` add up to those of their concatenation."""
    x32 = x.detach().float()
    a = (
        absmax.float().clamp_min(1e-30)
        if isinstance(absmax, torch.Tensor)
        else torch.tensor(max(absmax, 1e-30), dtype=torch.float32)
    )
    y = torch.where(torch.isfinite(x32), x32, 0.0) / a.to(x32.device)
    return torch.histc(y, bins=bins, min=-1.0, max=1.0).double()


def ranks_absmax(vec: Vec) -> float | torch.Tensor:
    """The largest ``absmax`` (``vec[2]``) of every rank, NaN if any rank's is NaN (one
    ``all_reduce`` of two numbers): the range a histogram of the combined batch bins over."""
    import torch.distributed as dist

    a = vec[2]
    if isinstance(a, torch.Tensor):
        am = a.double().reshape(1)
    else:
        am = torch.tensor([a], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        am = am.to(torch.device("cuda", torch.cuda.current_device()))
    nan = torch.isnan(am)
    t = torch.cat([torch.where(nan, 0.0, am), nan.double()])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    top = torch.where(t[1] > 0, math.nan, t[0])
    return top.to(a.device) if isinstance(a, torch.Tensor) else float(top)


def _lower(a: float, b: float) -> float:
    """``min(a, b)``, NaN if either is NaN (as torch.aminmax)."""
    return a if (a < b or a != a) else b


def _upper(a: float, b: float) -> float:
    return a if (a > b or a != a) else b


def _fused_stats(a: np.ndarray, scratch: Scratch) -> tuple[float, float, float, float, int]:
    """``(sum, sum of squares, min, max, nonzero count)`` of a 1-D float32 array, NumPy block by
    block (each block is read from cache by all five reductions). min/max are NaN if any value is
    NaN."""
    n = a.shape[0]
    # Block by block (see _BLOCK), inlined: at 256 KiB a block's reductions take ~40 us, so a
    # few calls of Python overhead each would cost 10-15 %.
    s = q = 0.0
    mn, mx = math.inf, -math.inf
    nonzero = 0
    dot = np.dot
    ones, mask = _ONES, scratch.mask(min(n, _BLOCK))
    for i in _blocks(n):
        ab = a[i : i + _BLOCK]
        m = ab.shape[0]
        lo, hi = float(_MIN(ab)), float(_MAX(ab))
        mn, mx = _lower(mn, lo), _upper(mx, hi)
        with np.errstate(over="ignore", invalid="ignore"):
            bs = float(dot(ab, ones if m == _BLOCK else ones[:m]))  # BLAS: faster than a sum
            bq = float(dot(ab, ab))
        if (
            (not (math.isfinite(bs) and math.isfinite(bq)) or (bq < _TINY and (lo or hi)))
            and math.isfinite(lo)
            and math.isfinite(hi)
        ):
            # finite values whose fp32 sums overflow (near 1e19 and beyond), or whose squares
            # underflow (all below ~1e-15: their fp32 squares lose their bits, 0 below ~1e-23,
            # a std of 0): in float64
            w = ab.astype(np.float64)
            bs, bq = float(w.sum()), float(np.dot(w, w))
        s += bs
        q += bq
        if lo > 0 or hi < 0:
            nonzero += m  # no value can be 0
        else:
            nonzero += int(np.count_nonzero(np.not_equal(ab, 0, out=mask[:m])))
    return s, q, mn, mx, nonzero


def _act_stats_cpu(x: torch.Tensor, n: int, scratch: Scratch) -> list[float]:
    a = _host_array(x)
    s, q, mn, mx, nonzero = _fused_stats(a, scratch)
    absmax = absmax_of(mn, mx)
    if not (math.isfinite(s) and math.isfinite(absmax)):  # non-finite values: exact, slower path
        x = torch.from_numpy(a)  # the same memory
        mean = float(x.mean())
        std = float(x.std()) if n > 1 else math.nan
        nonzero = int(torch.count_nonzero(x))
        finite = float(torch.count_nonzero(torch.isfinite(x)))
        return [mean, std, absmax, float(nonzero), finite]
    mean = s / n
    std = math.nan
    if n > 1:
        # One pass, sum(x*x) (blocked dots, ~1e-7), when the mean is small against the spread
        # (cancellation below ~1e-6), else a second pass: sum((x - mean)^2).
        var = (q - n * mean * mean) / (n - 1)
        if not (var > 0 and q <= 4.0 * n * var and math.isfinite(q)):
            var = _centred_sumsq(a, mean, scratch.floats(min(n, _BLOCK))) / (n - 1)
        std = math.sqrt(var)
    return [mean, std, absmax, float(nonzero), float(n)]


def _centred_sumsq(a: np.ndarray, c: float, buf: np.ndarray) -> float:
    """``sum((a - mean) ** 2)`` from the values shifted by ``c`` (the mean, rounded to fp32):
    ``sum(d * d) - sum(d) ** 2 / n`` with ``d = a - c``, blocked (``buf``: a block-sized fp32
    scratch). The correction removes what rounding ``c`` adds, which matters when the spread is
    small against the mean."""
    q = s = 0.0
    c32 = np.float32(c)
    for i in _blocks(a.shape[0]):
        ab = a[i : i + _BLOCK]
        m = ab.shape[0]
        d = np.subtract(ab, c32, out=buf[:m])
        with np.errstate(over="ignore", invalid="ignore"):
            bs, bq = float(np.dot(d, _ONES[:m])), float(np.dot(d, d))
        if not (math.isfinite(bs) and math.isfinite(bq)) or (bq < _TINY and np.any(d)):
            # deviations whose fp32 squares overflow (a spread near 1e19 and beyond) or
            # underflow (all below ~1e-15): in float64, as in _fused_stats
            w = ab.astype(np.float64) - float(c32)
            bs, bq = float(w.sum()), float(np.dot(w, w))
        s += bs
        q += bq
    return max(q - s * s / a.shape[0], 0.0)


def grad_stats(g: torch.Tensor) -> Vec:
    """``[norm, min, max]`` of a gradient (``absmax = max(|min|, |max|)``): a float64 tensor on
    the gradient's CUDA device, or a list of floats for a CPU gradient."""
    g = g.detach()
    if g.device.type == "cpu" and g.numel():  # on the host already: accurate and fast, no sync
        a = _host_array(g)
        q, mn, mx, dot = 0.0, math.inf, -math.inf, np.dot
        for i in _blocks(a.shape[0]):  # blocks: as in _fused_stats
            ab = a[i : i + _BLOCK]
            lo, hi = float(_MIN(ab)), float(_MAX(ab))
            with np.errstate(over="ignore", invalid="ignore"):
                v = float(dot(ab, ab))
            if (
                (not math.isfinite(v) or (v < _TINY and (lo or hi)))
                and math.isfinite(lo)
                and math.isfinite(hi)
            ):
                # finite values whose fp32 square sum overflows (near 1e19 and beyond: the
                # output gradient of a step scaled by a GradScaler), or whose squares underflow
                # (all below ~1e-15: a vanishing gradient read as a norm of 0): in float64
                v = _wide_sumsq(ab)
            q += v
            mn, mx = _lower(mn, lo), _upper(mx, hi)
        return [math.sqrt(q), mn, mx]
    mn, mx = torch.aminmax(g)
    return torch.stack(
        [torch.linalg.vector_norm(g, 2, dtype=torch.float32), mn.float(), mx.float()]
    ).double()


def minmax(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of a non-empty floating tensor as an fp32 tensor on its device, NaN if any
    value is NaN: one :func:`torch.aminmax` pass, no host sync."""
    return torch.stack(torch.aminmax(t.detach())).float()


def param_stats(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    before: list[torch.Tensor] | None,
) -> Vec:
    """Rows ``[grad_norm, weight_norm, update_norm, before_norm]`` per parameter, flattened (a list
    of floats for CPU parameters, accurate norms; a float64 tensor with foreach ops on CUDA);
    missing values are NaN (a parameter without a gradient gets no grad statistics, never a fake
    zero). ``before`` (a snapshot owned by the caller) is overwritten."""
    n = len(weights)
    dev = weights[0].device
    w = [p.detach() for p in weights]
    if dev.type == "cpu":  # accurate norms (torch's fp32 norm loses up to 1e-3 on large tensors)
        rows: list[list[float]] = [[]] * n
        diff = np.empty(min(_BLOCK, max(p.numel() for p in w)), dtype=np.float32)
        # last parameter first, each from its end: what optimizer.step() wrote last is in cache
        for i in reversed(range(n)):
            g = grads[i]
            gn = cpu_norm(g) if g is not None else math.nan
            wa = _host_array(w[i])
            if before is None:
                rows[i] = [gn, math.sqrt(_sumsq(wa)), math.nan, math.nan]
                continue
            # weight, snapshot and their difference, block by block: each is read once
            ba = _host_array(before[i])
            wq = bq = uq = 0.0
            for j in _blocks(wa.shape[0]):
                wb, bb = wa[j : j + _BLOCK], ba[j : j + _BLOCK]
                wq += _sumsq(wb)
                bq += _sumsq(bb)
                uq += _sumsq(np.subtract(wb, bb, out=diff[: wb.shape[0]]))
            rows[i] = [gn, math.sqrt(wq), math.sqrt(uq), math.sqrt(bq)]
        return [v for row in rows for v in row]
    nan = torch.full((n,), math.nan, device=dev)
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
    return torch.stack(cols, dim=1).double().reshape(-1)


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
