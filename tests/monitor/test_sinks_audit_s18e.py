"""Audit s18e of the monitor's sinks in a training loop: a record reaches each sink with the
values and step it has, and a sink that fails does not shift or corrupt the later records."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _hand_means(net: nn.Sequential, xs: list[torch.Tensor]) -> list[float]:
    """The Tanh output mean of each step, by a plain hook on a copy trained the same way."""
    import copy

    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    got: list[float] = []
    h = ref[1].register_forward_hook(lambda m, a, o: got.append(o.mean().item()))
    try:
        for x in xs:
            ref(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        h.remove()
    return got


def test_a_sink_that_raises_once_does_not_shift_the_later_steps():
    """A sink raising at step 1 (a full disk, a network error) left the step half done: the
    next step() recorded step 1 again, with step 1's stale layer statistics (its hooks were
    gone), and every later record carried the step before its own: [0, 1, 1, 2], silently.
    Now the step completes, the other sinks still get the record, and the error is raised
    after, naming the sink and the step."""
    net = _net()
    xs = [torch.randn(5, 4) for _ in range(4)]
    want = _hand_means(net, xs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls: list[int] = []
    seen: list[int] = []

    def flaky(rec: hs.MonitorRecord) -> None:
        calls.append(rec.step)
        if len(calls) == 2:
            raise OSError("disk full")

    raised = []
    with hs.Monitor(net, sinks=[flaky, lambda r: seen.append(r.step)], alerts="off") as mon:
        for i, x in enumerate(xs):
            net(x).pow(2).mean().backward()
            opt.step()
            try:
                mon.step(opt)
            except OSError as e:
                raised.append((i, "".join(getattr(e, "__notes__", []))))
            opt.zero_grad()
        assert [r.step for r in mon.records] == [0, 1, 2, 3]
        assert mon.step_index == 4
        got = [r.layers["1"]["mean"] for r in mon.records]
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(got, want))
    assert seen == [0, 1, 2, 3]  # the sink after the failing one got every record
    assert calls == [0, 1, 2, 3]
    assert len(raised) == 1 and raised[0][0] == 1
    assert "step 1" in raised[0][1] and "flaky" in raised[0][1]


def test_a_warning_turned_into_an_error_does_not_shift_the_later_steps():
    """Under ``-W error`` an alert raised out of step(), which likewise left the step half done."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, thresholds={"vanishing": 1e9}) as mon:
        for _ in range(2):
            net(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            with pytest.warns(hs.MonitorWarning):
                mon.step(opt)
            opt.zero_grad()
        with pytest.raises(hs.MonitorWarning):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                net(torch.randn(5, 4)).pow(2).mean().backward()
                opt.step()
                mon.step(opt)
        assert [r.step for r in mon.records] == [0, 1, 2]
        assert mon.step_index == 3
