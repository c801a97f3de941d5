"""Audit of hs.compare, session 17: models as users hand them over (wrapped in
``nn.DataParallel``), each checked against a plain run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def _net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8))
    return net, torch.randn(4, 8)


def test_a_model_wrapped_in_data_parallel_is_compared_as_the_model_it_wraps(tmp_path):
    """``nn.DataParallel(b)``: every name carried a ``module.`` prefix, nothing paired but the
    root, and a fault in ``2`` was blamed on the whole model. The wrapper is now set aside, on
    either side and in a record, and the fault is named with the plain runs' error."""
    a, x = _net()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[2].weight[0, 0] += 1.0
    report = hs.compare(a, nn.DataParallel(b), x, loss_fn=_loss)
    assert report.unmatched == [] and report.culprit == "2", report
    with torch.no_grad():
        h = a[1](a[0](x))
        want = float((b[2](h) - a[2](h)).norm() / a[2](h).norm())
    assert report.row("2").local_error == pytest.approx(want, rel=1e-5)
    again = hs.compare(nn.DataParallel(a), b, x, loss_fn=_loss)
    assert again.culprit == "2" and again.row("2").local_error == pytest.approx(want, rel=1e-5)
    dp = nn.DataParallel(a)
    with hs.record(dp, tmp_path / "rec"):
        _loss(dp(x)).backward()
    a.zero_grad(set_to_none=True)
    recorded = hs.compare(str(tmp_path / "rec"), b, x, loss_fn=_loss)
    assert recorded.unmatched == [] and recorded.culprit == "2", recorded
    assert hs.compare(a, nn.DataParallel(copy.deepcopy(a)), x, loss_fn=_loss).culprit is None
