"""core._random: which module call drew random numbers, for the refusals of the products that
compare runs (compare, patching, CAM, steering)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.core._random import draw_fix, draw_place, drawing_module, random_draws


class _Drops(nn.Module):
    def __init__(self, always: bool) -> None:
        super().__init__()
        self.always = always

    def forward(self, x):
        return F.dropout(x, 0.5, training=True if self.always else self.training)


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x * torch.rand(x.shape, generator=self.gen)


def _net(last: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Tanh(), last))


@pytest.mark.parametrize(
    "last, where",
    [(_Drops(True), "2.1"), (_OwnGenerator(), "2.1"), (_Drops(False), None), (nn.Tanh(), None)],
    ids=["functional-dropout", "own-generator", "eval-dropout", "none"],
)
def test_the_innermost_call_that_drew_is_named_and_the_model_left_as_found(last, where):
    """The innermost module whose call drew (from the global generators or one a module holds;
    its ancestors drew too, through it) is named, else None; the check runs the forward again
    with buffers (BatchNorm running statistics in training mode) put back and no hook left."""
    torch.manual_seed(0)
    net = _net(last)
    net.train()
    net[2].eval()
    x = torch.randn(3, 4)
    stats = net[1].running_mean.clone()
    with random_draws(net) as draws:
        net[2](x)  # the plain check the products make first
    assert draws.drew == (where is not None)
    assert drawing_module(net, lambda: net(x)) == where
    torch.testing.assert_close(net[1].running_mean, stats, rtol=0, atol=0)
    assert hs.hooks_on(net) == []


def test_a_draw_outside_every_call_or_a_forward_that_raises_names_none():
    net = nn.Sequential(nn.Linear(4, 4))

    def outside():
        torch.rand(2)
        return net(torch.ones(1, 4))

    assert drawing_module(net, outside) is None
    assert drawing_module(net, lambda: net(torch.ones(1, 5))) is None  # a shape error
    assert drawing_module(net, lambda: (torch.rand(1), net(torch.ones(1, 4)))) is None
    assert hs.hooks_on(net) == []


def test_the_place_and_the_fix_say_what_applies():
    """eval() is the fix only where modules are in training mode."""
    net = _net(_Drops(True)).eval()
    x = torch.randn(3, 4)
    assert draw_place(net, lambda: net(x)) == " in the forward of '2.1' (_Drops)"
    assert draw_place(nn.Tanh(), lambda: torch.rand(1)) == " in its forward"
    fix = draw_fix(net)
    assert "no module is in training mode" in fix and "eval() does not help" in fix
    net[2][1].train()
    assert draw_fix(net).startswith("call model.eval() first (modules in training mode: '2.1'")


def test_the_check_leaves_a_layer_s_python_state_as_found():
    """drawing_module's second run of the forward leaves a layer's call counter, list and tensor
    attribute as found (the products call it before telling the user what to fix)."""
    from helpers.common import Counting

    torch.manual_seed(0)
    net = nn.Sequential(Counting(3), nn.Dropout(0.5)).train()
    x = torch.randn(2, 3)
    assert drawing_module(net, lambda: net(x)) == "1"
    assert net[0].state() == (False, 0, [], 0.0)
