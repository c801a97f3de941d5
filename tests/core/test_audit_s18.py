"""Audit (round 18) of the core engine: each test failed before its fix, for the reason it names.

References are independent of hookscope: gradients from ``torch.autograd.grad`` of a fresh
forward, values from the plain computation.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Identity(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_captured_gradients_do_not_alias_a_leafs_grad():
    """A gradient reaching a leaf unchanged (the input of a first layer, an Identity on the input)
    was kept as autograd's own buffer, which ``AccumulateGrad`` adopts as ``x.grad``: a later
    ``x.grad.zero_()`` (``optimizer.zero_grad(set_to_none=False)``) or a second backward adding
    into ``x.grad`` in place changed the captured gradients."""
    net = _net()
    x = torch.randn(2, 3, requires_grad=True)
    (ref,) = torch.autograd.grad(net(x).sum(), x)  # d loss / d x: the gradient at "0" and "1"
    with hs.capture(net, ["0", "1"], inputs=True, grads=True) as cap:
        net(x).sum().backward()
    net(x).sum().backward()  # accumulates into x.grad in place
    assert torch.equal(cap.grads["0"], ref)
    assert torch.equal(cap.last("0").input_grad.args[0], ref)
    assert torch.equal(cap.last("1").input_grad.args[0], ref)
    x.grad.zero_()  # what zero_grad(set_to_none=False) does
    assert torch.equal(cap.grads["0"], ref)


def test_tensor_grads_do_not_alias_a_leafs_grad():
    y = torch.randn(3, requires_grad=True)
    with hs.tensor_grads(y) as tg:
        (y * 2).sum().backward()
    y.grad.mul_(0)
    assert torch.equal(tg[0], torch.full((3,), 2.0))
