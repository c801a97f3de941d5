"""Monitor sinks, audit leftovers (s20): a second failing sink, TensorBoard histogram bounds,
histograms in JSON Lines, values below float32's range in TensorBoard."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs

_TINY = float(np.float32(2.0**-149))  # float32's smallest positive value


def _relu_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_a_second_failing_sink_is_named_on_the_raised_error():
    """Two sinks raising on one step: the first error was raised and the second dropped without
    a word. Now the raised (first) error carries a note naming the second sink and its error;
    every sink still got the record."""
    net = nn.Linear(4, 2)
    seen = []

    def first(r):
        raise KeyError("first-broke")

    def second(r):
        raise ValueError("second-broke")

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, sinks=[first, second, lambda r: seen.append(r.step)], alerts="off") as mon:
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        with pytest.raises(KeyError, match="first-broke") as info:
            mon.step(opt)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "first" in notes and "step 0" in notes
    assert "second" in notes and "ValueError" in notes and "second-broke" in notes
    assert seen == [0] and [r.step for r in mon.records] == [0]


def _tb_histograms(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder), size_guidance={"histograms": 0}).Reload()
    return {t: ea.Histograms(t) for t in ea.Tags()["histograms"]}


def test_tensorboard_histogram_min_max_are_the_values_bounds(tmp_path):
    """A ReLU layer's histogram was written with min = -absmax (its minimum is 0). Now min/max
    are the outer edges of the first and last non-empty buckets: they bound the values."""
    pytest.importorskip("tensorboard")
    net = _relu_net()
    x = torch.randn(16, 4)
    sink = hs.TensorBoardSink(str(tmp_path), histograms=True)
    with hs.Monitor(net, sinks=[sink], alerts="off") as mon:
        net(x).sum().backward()
        mon.step()
    sink.close()
    rec = mon.records[0]
    key = next(t for t in rec.histograms if t.endswith("/1"))  # the ReLU
    limits = rec.histograms[key][0]
    relu = net[1](net[0](x)).detach()
    got = _tb_histograms(tmp_path)[key][0].histogram_value
    assert got.min == 0.0  # the bucket starting at 0 (ReLU: nothing below)
    assert got.max == limits[-1] == pytest.approx(float(relu.max()))
    assert got.min <= float(relu.min()) and got.max >= float(relu.max())
    # the first Linear: signed values; its bounds are bucket edges enclosing them
    k0 = next(t for t in rec.histograms if t.endswith("/0"))
    lim0, c0 = rec.histograms[k0]
    h0 = _tb_histograms(tmp_path)[k0][0].histogram_value
    lin = net[0](x).detach()
    first = next(j for j, c in enumerate(c0) if c)
    last = max(j for j, c in enumerate(c0) if c)
    assert h0.min == (lim0[first - 1] if first else -lim0[-1])
    assert h0.max == lim0[last]
    assert h0.min <= float(lin.min()) and h0.max >= float(lin.max())
    assert h0.num == sum(c0) and list(h0.bucket) == list(c0)


def test_jsonl_sink_writes_the_histograms(tmp_path):
    """``JsonlSink`` (documented as the record that holds the values) dropped the histograms:
    ``to_dict()`` leaves them out. Now a line of a record with histograms holds them."""
    net = _relu_net()
    path = tmp_path / "mon.jsonl"
    sink = hs.JsonlSink(path)
    with hs.Monitor(net, sinks=[sink], histograms=8, alerts="off") as mon:
        net(torch.randn(16, 4)).sum().backward()
        mon.step()
    sink.close()
    rec = mon.records[0]
    assert rec.histograms
    line = json.loads(path.read_text().splitlines()[0])
    assert line["histograms"] == {t: [list(a), list(c)] for t, (a, c) in rec.histograms.items()}
    assert "histograms" not in rec.to_dict()  # to_dict() unchanged
    # a record without histograms: no key
    sink = hs.JsonlSink(path)
    sink(hs.MonitorRecord(5, {"fc": {"mean": 0.5}}))
    sink.close()
    assert "histograms" not in json.loads(path.read_text().splitlines()[1])


def test_jsonl_histograms_nonfinite_edges_are_strings(tmp_path):
    path = tmp_path / "mon.jsonl"
    sink = hs.JsonlSink(path)
    rec = hs.MonitorRecord(1, histograms={"activations/fc": ([math.inf], [3.0])})
    rec.histogram_sums = {"activations/fc": (1.5, math.nan)}
    sink(rec)
    sink.close()
    line = json.loads(path.read_text())
    assert line["histograms"] == {"activations/fc": [["inf"], [3.0]]}
    assert line["histogram_sums"] == {"activations/fc": [1.5, "nan"]}


def _tb_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def test_tensorboard_values_below_float32_range_are_not_zero(tmp_path):
    """An ``update_ratio`` of 1e-50 was stored by TensorBoard (float32) as 0, silently. Now it
    is written as float32's smallest positive value (its sign kept), with a warning (once)
    naming the tag; a subnormal float32 and an exact 0 are written as they are."""
    pytest.importorskip("tensorboard")
    sink = hs.TensorBoardSink(str(tmp_path))
    rec = hs.MonitorRecord(
        2,
        {"fc": {"mean": -1e-60, "zeros": 0.0}},
        {"fc.weight": {"update_ratio": 1e-50, "grad_norm": 1e-40}},
    )
    with pytest.warns(
        hs.HookscopeWarning,
        match=r"mean/fc = -1e-60, param_update_ratio/fc\.weight = 1e-50.*float32",
    ):
        sink(rec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink(hs.MonitorRecord(3, {}, {"fc.weight": {"update_ratio": 1e-50}}))  # said once
    sink.close()
    got = _tb_scalars(tmp_path)
    assert got["param_update_ratio/fc.weight"] == [(2, _TINY), (3, _TINY)]
    assert got["mean/fc"] == [(2, -_TINY)]
    assert got["zeros/fc"] == [(2, 0.0)]
    assert got["param_grad_norm/fc.weight"] == [(2, float(np.float32(1e-40)))]
