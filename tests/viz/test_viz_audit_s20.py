"""Plots audit (s20): the numbers drawn, read back from the matplotlib artists, against the data.

Non-finite values were dropped without a word, values clipped to a floor or a ceiling, and maps of
NaN drawn as blank pictures.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hookscope as hs
from hookscope.compare._report import CompareReport, CompareRow

pytest.importorskip("matplotlib")


def _texts_at(ax, i):
    return [t.get_text() for t in ax.texts if abs(t.xy[0] - i) < 1e-9]


def _records():
    g = lambda v: {"grad_norm": v}  # noqa: E731
    return [
        hs.MonitorRecord(
            0,
            params={"a": g(1.0), "b": g(math.inf), "c": g(0.0), "d": g(1e-15), "e": g(3.0)},
        ),
        hs.MonitorRecord(
            1,
            params={"a": g(math.nan), "b": g(math.nan), "c": g(0.0), "d": g(3e-15), "e": g(5.0)},
        ),
    ]


def test_grad_flow_bars_are_the_records_and_non_finite_values_are_labelled():
    fig = hs.plot_grad_flow(_records())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d", "e"]
    maxes, means = (
        [p.get_height() for p in c.patches] for c in ax.containers
    )  # max bars, then mean bars
    # a: the finite value 1.0, its NaN labelled; e: mean 4, max 5; d: 2e-15 and 3e-15, not a floor
    assert means[0] == 1.0 and maxes[0] == 1.0 and "NaN x1" in _texts_at(ax, 0)
    assert means[4] == 4.0 and maxes[4] == 5.0 and not _texts_at(ax, 4)
    assert means[3] == pytest.approx(2e-15, rel=1e-12) and maxes[3] == 3e-15
    # b: only inf and NaN: no bar, both named
    assert math.isnan(means[1]) and _texts_at(ax, 1) == ["inf x1, NaN x1"]
    # c: zero on a log axis: drawn at the foot, below every value, and labelled 0
    assert means[2] < 1e-15 and _texts_at(ax, 2) == ["0"]


def test_grad_flow_refuses_a_negative_statistic_on_its_log_scale():
    recs = [hs.MonitorRecord(0, layers={"a": {"mean": -0.5}, "b": {"mean": 0.2}})]
    with pytest.raises(ValueError, match=r"log scale.*'mean' is negative in a"):
        hs.plot_grad_flow(recs, source="layers", stat="mean")


def _report(errors):
    rows = [
        CompareRow(name=f"m{i}", index=0, kind="Linear", depth=1, end=i, error=e, tol=1e-2)
        for i, e in enumerate(errors)
    ]
    return CompareReport(rows, None, [], None, [], ("float32", "bfloat16"))


def test_compare_plot_draws_errors_as_they_are_and_labels_non_finite_ones():
    errors = [0.5, 5e4, math.inf, math.nan, 0.0, 1e-15]
    fig = _report(errors).plot()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"m{i}" for i in range(6)]
    y = ax.lines[0].get_ydata()
    assert y[0] == 0.5 and y[1] == 5e4 and y[5] == 1e-15  # were 1e3 and 1e-12
    assert "inf" in _texts_at(ax, 2) and "NaN" in _texts_at(ax, 3)
    assert y[4] < 1e-15 and "0" in _texts_at(ax, 4)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_feature_maps_refuse_non_finite_activations(bad):
    a = torch.rand(4, 5, 5)
    a[2, 1, 1] = bad
    with pytest.raises(hs.HookscopeError, match=r"channel 2"):
        hs.feature_maps(a)


def test_feature_maps_show_the_values_given():
    a = torch.rand(3, 4, 4) * 5
    fig = hs.feature_maps(a, order="index", normalize="global")
    shown = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    ref = (a - a.min()) / (a.max() - a.min())
    for k in range(3):
        np.testing.assert_allclose(np.asarray(shown[k]), ref[k].numpy(), rtol=1e-6)
