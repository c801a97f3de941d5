"""Audit findings for patch_sweep / attribution_patch (owner: patching). Each test fails on main
for the reason given."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.skip(reason="audit finding, not yet fixed")


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.5))  # training=True whatever the mode


class _OwnGenerator(nn.Module):
    """A stochastic forward that draws from its own generator, not torch's global one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * (torch.rand(h.shape, generator=self.g) > 0.5))


def _metric(out: torch.Tensor) -> torch.Tensor:
    return out[:, 0].sum()


def test_random_forward_error_on_an_eval_model_does_not_tell_the_user_to_call_eval():
    """User sweeps a model already in eval() whose forward calls F.dropout(x, 0.5): the error says
    "modules in training mode: none ... call model.eval() first", a fix that is already applied
    and does nothing; it should say the randomness is not from a module's mode (functional dropout
    with training=True, a sampling layer) and name what to do instead."""
    torch.manual_seed(0)
    net = _FunctionalDropout().eval()
    clean, corrupt = torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(hs.PatchingError) as err:
        hs.patch_sweep(net, clean, corrupt, _metric, ["a"], over=())
    assert "call model.eval() first" not in str(err.value)


def test_patch_sweep_sees_a_forward_that_draws_from_its_own_generator():
    """User sweeps an eval model whose forward samples with its own torch.Generator: two identical
    sweeps return -0.1231 and 0.1687, with no warning (random_draws only watches the global
    generators); the sweep should refuse like it does for global-RNG dropout (e.g. by comparing two
    clean runs, as issue 33 asks: "compare two runs")."""
    torch.manual_seed(0)
    net = _OwnGenerator().eval()
    clean, corrupt = torch.randn(1, 8), torch.randn(1, 8)
    try:
        a = hs.patch_sweep(net, clean, corrupt, _metric, ["a"], over=())
        b = hs.patch_sweep(net, clean, corrupt, _metric, ["a"], over=())
    except hs.HookscopeError:
        return
    torch.testing.assert_close(a, b)
