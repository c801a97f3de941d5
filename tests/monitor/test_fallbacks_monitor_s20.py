"""Fallbacks in the monitor (audit s20): each path taken after another failed is exact or said."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs


class _Scaled(nn.Module):
    """A layer whose output is ``x * k + c``: its values' scale and offset set by hand."""

    def __init__(self, k: float, c: float) -> None:
        super().__init__()
        self.k, self.c = k, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k + self.c


@pytest.mark.parametrize(
    ("k", "c"),
    [
        (1e-25, 0.0),  # squares below fp32's smallest: the std read 0
        (1e-21, 0.0),  # squares subnormal: the std lost its bits
        (1e19, 1e20),  # a spread whose centred squares overflow: the std read inf
    ],
)
def test_activation_std_of_values_far_from_one_equals_torch(k, c):
    """The CPU statistics sum squares in fp32; the float64 fallback was taken where those sums
    overflowed in the first pass only: squares that underflow (a layer's values near 1e-25: std
    0 instead of 1e-25) and a second, centred pass that overflows (a spread of 1e19 around
    1e20: std inf, with a numpy RuntimeWarning) were read as they came. Reference: torch's std
    of the layer's output in float64."""
    torch.manual_seed(0)
    net = nn.Sequential(_Scaled(k, c))
    x = torch.randn(64, 256)
    with hs.Monitor(net, alerts="off") as mon:
        out = net(x)
        rec = mon.step()
    ref = out.detach().double()
    got = rec.layers["0"]
    assert math.isclose(got["std"], float(ref.std()), rel_tol=1e-6)
    assert math.isclose(
        got["mean"], float(ref.mean()), rel_tol=1e-6, abs_tol=1e-6 * float(ref.std())
    )


def test_a_vanishing_gradient_s_norm_equals_torch():
    """Gradients near 1e-25 (a vanishing gradient): their fp32 squares underflowed to 0, and the
    layer's and the parameter's grad_norm read 0, a dead layer's reading. Reference: the norm
    of the gradient computed by hand, in float64."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), _Scaled(1.0, 0.0))
    x = torch.randn(8, 16)
    with hs.Monitor(net, alerts="off") as mon:
        out = net(x)
        out.retain_grad()
        (out.sum() * 1e-25).backward()
        rec = mon.step()
    g_out = out.grad.double()
    g_w = net[0].weight.grad.double()
    net.zero_grad()
    assert math.isclose(rec.layers["1"]["grad_norm"], float(g_out.norm()), rel_tol=1e-6)
    assert math.isclose(rec.params["0.weight"]["grad_norm"], float(g_w.norm()), rel_tol=1e-6)
