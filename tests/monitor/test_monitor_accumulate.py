"""Gradient accumulation: one record per optimizer step, equal to one step on the combined batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import mlp6


def _assert_records_equal(a: hs.MonitorRecord, b: hs.MonitorRecord) -> None:
    assert a.layers.keys() == b.layers.keys() and a.params.keys() == b.params.keys()
    for group_a, group_b in ((a.layers, b.layers), (a.params, b.params)):
        for name in group_a:
            assert group_a[name].keys() == group_b[name].keys(), name
            for stat, v in group_a[name].items():
                w = group_b[name][stat]
                assert math.isclose(v, w, rel_tol=2e-5, abs_tol=1e-7), (name, stat, v, w)


def _run(
    net: nn.Module, batches: list[torch.Tensor], targets: list[torch.Tensor], micro: int, **kw
):
    """Two optimizer steps; each made of ``micro`` micro-batches of the given batches."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with hs.Monitor(net, alerts="off", **kw) as mon:
        for x, y in zip(batches, targets):
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                (nn.functional.cross_entropy(net(xs), ys) / micro).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        return list(mon.records)


@pytest.mark.parametrize("micro", [2, 4])
def test_accumulated_step_equals_the_combined_batch(micro):
    torch.manual_seed(1)
    xs = [torch.randn(8, 6) for _ in range(2)]
    ys = [torch.randint(0, 3, (8,)) for _ in range(2)]
    base = mlp6()
    whole = _run(copy.deepcopy(base), xs, ys, 1)
    accumulated = _run(copy.deepcopy(base), xs, ys, micro)
    assert [r.step for r in accumulated] == [0, 1]  # one record per optimizer step
    for a, b in zip(accumulated, whole):
        _assert_records_equal(a, b)
    # the statistics really cover every micro-batch: not the last one alone
    last = _run(copy.deepcopy(base), [xs[0][-8 // micro :]], [ys[0][-8 // micro :]], 1)[0]
    assert not math.isclose(accumulated[0].layers["1"]["mean"], last.layers["1"]["mean"])


def test_micro_batch_marks_passes_when_the_monitored_module_is_not_called():
    """A training step that calls a sub-module directly (as a LightningModule's training_step
    may): ``micro_batch()`` keeps micro-batches together instead of numbering them as calls."""
    torch.manual_seed(2)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    base = mlp6()

    class Wrapper(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

    whole = _run(copy.deepcopy(base), [x], [y], 1)[0]
    w = Wrapper(copy.deepcopy(base))
    opt = torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9)
    with hs.Monitor(w, alerts="off") as mon:
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            mon.micro_batch()
            (nn.functional.cross_entropy(w.net(xs), ys) / 2).backward()
        opt.step()
        rec = mon.step(opt)
        opt.zero_grad()
    assert "net.1#1" not in rec.layers
    renamed = hs.MonitorRecord(
        0,
        {k.removeprefix("net."): v for k, v in rec.layers.items()},
        {k.removeprefix("net."): v for k, v in rec.params.items()},
    )
    _assert_records_equal(renamed, whole)


def test_without_micro_batch_marks_direct_calls_stay_separate_calls():
    torch.manual_seed(3)
    net = mlp6()
    x = torch.randn(4, 6)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

    w = Wrapper()
    with hs.Monitor(w, alerts="off", stats=("activations",)) as mon:
        w.net(x[:2])
        w.net(x[2:])
        rec = mon.step()
    a0, a1 = torch.tanh(net[0](x[:2])), torch.tanh(net[0](x[2:]))
    assert math.isclose(rec.layers["net.1"]["mean"], a0.mean().item(), rel_tol=1e-5)
    assert math.isclose(rec.layers["net.1#1"]["mean"], a1.mean().item(), rel_tol=1e-5)
