"""A training loop that calls optimizer.zero_grad() before monitor.step(): every record had no
parameter grad_norm (or 0 with set_to_none=False) without a word, while the layers' output
gradients were recorded. Now a MonitorWarning says so once, with the order to call them in; the
loop in that order records the gradient norms a hand computation gives."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _loop(set_to_none: bool | None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    mon = hs.Monitor(model, every=1)
    records, hand = [], []
    with mon:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            hand.append(float(model[0].weight.grad.norm()))
            opt.step()
            if set_to_none is not None:
                opt.zero_grad(set_to_none=set_to_none)
            records.append(mon.step(opt))
            opt.zero_grad()
    return records, hand


@pytest.mark.parametrize("set_to_none, what", [(True, "had a gradient"), (False, "all zeros")])
def test_zero_grad_before_step_is_said_once(set_to_none, what):
    with pytest.warns(hs.MonitorWarning, match=f"step 0: .*{what}.*zero_grad.* before step") as w:
        _loop(set_to_none)
    assert sum("zero_grad" in str(m.message) for m in w) == 1


def test_the_right_order_records_the_gradient_norms():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records, hand = _loop(None)
    for rec, g in zip(records, hand):
        assert rec.params["0.weight"]["grad_norm"] == pytest.approx(g, rel=1e-6)
