"""Audit s18e of clip_grads in a training loop: it clips each backward's gradient, so a second
backward before the optimizer step (gradient accumulation) adds to a clipped .grad; that is
said, and the values are checked against the same clipping done by hand."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def test_accumulated_gradients_over_max_norm_are_said():
    """Two backward passes, then the optimizer step: each pass's gradient was clipped to 0.1,
    their sum in .grad had norm 0.2 > max_norm=0.1, silently (under DDP, clip_grads clips the
    accumulated gradient once: 0.1). Now a warning names the parameter and the fix; the value is
    the sum of the hand-clipped gradients."""
    net = _net()
    xs = [torch.ones(3, 4), torch.ones(3, 4) * 2]
    ref = {}
    for n, p in net.named_parameters():
        total = torch.zeros_like(p)
        for x in xs:
            (g,) = torch.autograd.grad(net(x).sum(), p)
            total += g * min(1.0, 0.1 / g.norm().item())
        ref[n] = total
    with (
        pytest.warns(hs.HookscopeWarning, match=r"(?s)clip_grads.*'(weight|bias)'.*accumulat"),
        hs.clip_grads(net, max_norm=0.1),
    ):
        for x in xs:
            net(x).sum().backward()
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref[n])
    assert net.weight.grad.norm().item() > 0.1 + 1e-3


@pytest.mark.parametrize("set_to_none", [True, False])
def test_one_backward_per_step_is_not_said(set_to_none):
    """zero_grad (to None, or to zeros in place) between steps: no accumulation, no warning;
    each step's .grad equals the hand-clipped gradient."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.clip_grads(net, max_norm=0.1):
            for k in range(3):
                x = torch.ones(3, 4) * (k + 1)
                want = {}
                for n, p in net.named_parameters():
                    (g,) = torch.autograd.grad(net(x).sum(), p)
                    want[n] = g * min(1.0, 0.1 / g.norm().item())
                net(x).sum().backward()
                for n, p in net.named_parameters():
                    torch.testing.assert_close(p.grad, want[n])
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
