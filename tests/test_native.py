"""The monitor's optional native kernels (``hookscope.monitor._native``): values against float64, the
build cache, and the NumPy fallback when they cannot be built or are switched off."""

from __future__ import annotations

import logging
import math
import os
import shutil

import numpy as np
import pytest
import torch

from hookscope.monitor import _native
from hookscope.monitor._stats import Scratch, act_stats, grad_stats, minmax

HAVE_CC = shutil.which(os.environ.get("CC", "cc").split()[0]) is not None


@pytest.fixture
def k(native_kernels: _native.Kernels) -> _native.Kernels:
    return native_kernels


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A fresh cache folder and no loaded kernels; the session's kernels are restored after."""
    monkeypatch.setenv("HOOKSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(_native, "_loaded", [])
    return tmp_path


# lengths around the kernel's lanes (64) and sub-chunks (2048), tails included
LENGTHS = [1, 2, 63, 64, 65, 2047, 2048, 2049, 3 * 2048 + 17, 100_003, 1_000_000]


@pytest.mark.parametrize("n", LENGTHS)
def test_stats_equal_float64(k, n):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n) * 3 + 0.7).astype(np.float32)
    a[rng.random(n) < 0.3] = 0.0
    a[rng.random(n) < 0.05] = -0.0  # a zero too
    s, q, mn, mx, zeros = k.stats(a)
    d = a.astype(np.float64)
    assert math.isclose(s, d.sum(), rel_tol=1e-6, abs_tol=1e-6 * np.abs(d).sum())
    assert math.isclose(q, (d * d).sum(), rel_tol=1e-6)
    assert (mn, mx) == (float(a.min()), float(a.max()))
    assert zeros == float(np.count_nonzero(a == 0))


@pytest.mark.parametrize("n", LENGTHS)
def test_grad_stats_equal_float64(k, n):
    rng = np.random.default_rng(n + 1)
    a = (rng.standard_normal(n) * 1e-3 - 2e-4).astype(np.float32)
    a[rng.random(n) < 0.1] = 0.0
    q, mn, mx = k.grad_stats(a)
    d = a.astype(np.float64)
    assert math.isclose(q, (d * d).sum(), rel_tol=1e-6)
    assert (mn, mx) == (float(a.min()), float(a.max()))


@pytest.mark.parametrize("n", LENGTHS)
def test_update_sumsq_equal_float64(k, n):
    rng = np.random.default_rng(n)
    w = rng.standard_normal(n).astype(np.float32)
    b = (w + rng.standard_normal(n).astype(np.float32) * 1e-3).astype(np.float32)
    got = k.update_sumsq(w, b)
    dw, db = w.astype(np.float64), b.astype(np.float64)
    du = (w - b).astype(np.float64)  # the update as fp32 computes it
    for g, e in zip(got, [(dw * dw).sum(), (db * db).sum(), (du * du).sum()]):
        assert math.isclose(g, e, rel_tol=1e-6)


def test_non_finite_values_make_the_sum_non_finite(k):
    """The kernel's min/max skip NaN; callers rely on the sum (and sum of squares) turning
    non-finite instead, wherever the bad value is."""
    for bad in (math.nan, math.inf, -math.inf):
        for pos in (0, 2047, 2048, 50_000, 99_999):
            a = np.ones(100_000, np.float32)
            a[pos] = bad
            s, q, *_ = k.stats(a)
            assert not (math.isfinite(s) and math.isfinite(q)), (bad, pos)
            assert not math.isfinite(k.grad_stats(a)[0]), (bad, pos)
    w = np.ones(5000, np.float32)
    w[4321] = math.nan
    assert all(math.isnan(v) for v in k.update_sumsq(w, w)[0:3:2])


def test_monitor_values_do_not_depend_on_the_kernels(monkeypatch, k):
    """act_stats and grad_stats with the kernels equal them with NumPy (to rounding), NaN cases
    included."""
    rng = torch.Generator().manual_seed(3)
    xs = [
        torch.randn(300_001, generator=rng).relu(),
        torch.randn(64, 3, 17, 17, generator=rng),
        torch.tensor([1.0, math.nan, 0.0, -0.0]),
        torch.tensor([math.inf, 0.0, 2.0]),
    ]

    def run() -> list[list[float]]:
        acts = [act_stats(x, None, 0.01, 0, Scratch())[0] for x in xs]
        return acts + [grad_stats(x) for x in xs]

    with_k = run()
    monkeypatch.setattr(_native, "_loaded", [None])
    without = run()
    for a, b in zip(with_k, without):
        for u, v in zip(a, b):
            assert (math.isnan(u) and math.isnan(v)) or math.isclose(u, v, rel_tol=1e-6), (a, b)


def test_expanded_and_strided_tensors_are_read_as_their_values(k):
    """A stride-0 (expanded) or strided tensor must not reach the kernels as a raw pointer: they
    would read the memory next to it. Here that memory holds other values, so it would show."""
    base = torch.arange(5000, dtype=torch.float32)
    cases = [
        base[:1].expand(4000),  # 4000 zeros; a dense read of base gives mean 1999.5
        base[:2].reshape(1, 2).expand(1000, 2),
        base[::3],
        base.reshape(50, 100)[:, :40],
    ]
    for x in cases:
        d = x.double()
        v, _ = act_stats(x, None, 0.01, 0, Scratch())
        assert math.isclose(v[0], float(d.mean()), rel_tol=1e-6, abs_tol=1e-9), x.stride()
        assert math.isclose(v[1], float(d.std()), rel_tol=1e-6, abs_tol=1e-9), x.stride()
        assert v[2:] == [float(d.abs().max()), float(torch.count_nonzero(d)), float(d.numel())]
        norm, mn, mx = grad_stats(x)
        assert math.isclose(norm, float(d.norm()), rel_tol=1e-6) and (mn, mx) == (d.min(), d.max())


def test_kernels_refuse_arrays_they_cannot_read_densely(k):
    a = np.arange(10, dtype=np.float32)
    for bad in (a[::2], a.astype(np.float64), a.reshape(2, 5)):
        with pytest.raises(ValueError, match="1-D contiguous float32"):
            k.stats(bad)
        with pytest.raises(ValueError, match="1-D contiguous float32"):
            k.grad_stats(bad)
    with pytest.raises(ValueError, match="equal shapes"):
        k.update_sumsq(a, a[:5])


def test_build_is_cached_and_leaves_no_partial_file(fresh):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    first = _native.kernels()
    assert first is not None and first.path.parent == fresh
    stamp = first.path.stat().st_mtime_ns
    _native.reset()
    again = _native.kernels()
    assert again is not None and again.path == first.path
    assert again.path.stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    assert [p.name for p in fresh.iterdir()] == [first.path.name]


def test_switched_off_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("HOOKSCOPE_NATIVE", "0")
    assert _native.kernels() is None
    assert list(fresh.iterdir()) == []  # nothing built


def test_no_compiler_falls_back_to_numpy(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "hookscope-no-such-compiler")
    with caplog.at_level(logging.DEBUG, logger="hookscope.native"):
        assert _native.kernels() is None
    assert "hookscope-no-such-compiler" in caplog.text
    x = torch.tensor([0.0, 1.0, -3.0, 2.0])
    v, _ = act_stats(x, None, 0.01, 0, Scratch())
    assert v[0] == 0.0 and v[2:] == [3.0, 3.0, 4.0]
    assert math.isclose(v[1], math.sqrt(14 / 3), rel_tol=1e-12)


def test_failed_build_falls_back_and_leaves_no_partial_file(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.DEBUG, logger="hookscope.native"):
        assert _native.kernels() is None
    assert "failed" in caplog.text
    assert list(fresh.iterdir()) == []


def test_kernels_that_disagree_with_numpy_are_refused(fresh, monkeypatch):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    monkeypatch.setattr(_native.Kernels, "stats", lambda self, a: [0.0, 0.0, 0.0, 0.0, 0.0])
    assert _native.kernels() is None


def test_a_wrong_gradient_kernel_is_refused_too(fresh, monkeypatch):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    real = _native.Kernels.grad_stats
    monkeypatch.setattr(_native.Kernels, "grad_stats", lambda self, a: real(self, a[1:]))
    assert _native.kernels() is None


def _with(value: float, n: int = 300_001) -> torch.Tensor:
    x = torch.randn(n)
    x[n // 2] = value
    return x


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(300_001),
        torch.randn(8, 64, 24, 24).to(memory_format=torch.channels_last),
        torch.arange(4000, dtype=torch.float32)[:1].expand(300_000),
        _with(math.nan),
        _with(math.inf),
        _with(-math.inf),
        torch.randn(300_000).bfloat16(),
        torch.randn(300_000, dtype=torch.float64),
        torch.randn(1000),  # below the kernel's size: aminmax
        torch.tensor([1.0, math.nan, -2.0]),
    ],
    ids=[
        "large",
        "channels-last",
        "expanded",
        "nan",
        "inf",
        "-inf",
        "bf16",
        "f64",
        "small",
        "small-nan",
    ],
)
def test_minmax_equals_aminmax(x, stats_backend):
    """The sentinel's reduction: [min, max] as fp32, NaN if any NaN, with or without the kernel."""
    got = minmax(x)
    want = torch.stack(torch.aminmax(x)).float()
    assert got.dtype == torch.float32 and got.device == x.device
    assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())
