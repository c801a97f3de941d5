"""Audit (s18) of find_nonfinite: a NaN/Inf made only in a parameter's gradient (every
activation and every activation gradient finite) was reported as "all finite" (None)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookscope as hs


class _SafeSqrt(nn.Module):
    """``x + where(w > 0, sqrt(w), 0)`` (``masked``) or ``x + sqrt(w)``: a finite forward at
    w = 0; the gradient of w is NaN (the where-NaN gradient: inf * 0) or Inf; that of x is 1."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.masked = masked
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.masked:
            return x + torch.where(self.w > 0, torch.sqrt(self.w), torch.zeros_like(self.w))
        return x + torch.sqrt(self.w)


@pytest.mark.parametrize(("masked", "kind"), [(False, "inf"), (True, "nan")])
def test_a_nonfinite_parameter_gradient_alone_is_located(masked, kind):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _SafeSqrt(masked), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    # the reference: a plain backward, activation gradients read by hand
    acts: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(acts.append)

    handles = [m.register_forward_hook(keep) for m in net]
    try:
        y = net(x.requires_grad_())
        assert torch.isfinite(y).all()
        y.sum().backward()
    finally:
        for h in handles:
            h.remove()
    assert all(torch.isfinite(g).all() for g in acts) and torch.isfinite(x.grad).all()
    bad = {n for n, p in net.named_parameters() if not torch.isfinite(p.grad).all()}
    assert bad == {"1.w"}
    ref = net[1].w.grad.abs().max().item()
    net.zero_grad(set_to_none=True)

    origin = hs.find_nonfinite(net, x.detach())
    assert origin is not None
    assert (origin.layer, origin.phase, origin.kind, origin.module_type) == (
        "1", "backward", kind, "_SafeSqrt",
    )  # fmt: skip
    got = origin.stats["grad_w_absmax"]
    assert (math.isnan(got) and math.isnan(ref)) or got == ref
    assert all(p.grad is None for p in net.parameters())  # no .grad changed


def test_a_nonfinite_parameter_gradient_of_a_compiled_model_is_named_by_its_eager_name():
    """The parameter's module in a ``torch.compile`` wrapper is named as in the eager model
    (``"1"``, not ``"_orig_mod.1"``), as every other layer hookscope names."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _SafeSqrt(False), nn.Linear(4, 1))
    origin = hs.find_nonfinite(torch.compile(net, backend="eager"), torch.randn(3, 4))
    assert origin is not None and (origin.layer, origin.kind) == ("1", "inf")
