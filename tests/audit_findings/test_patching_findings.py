"""Audit findings for patch_sweep / attribution_patch (owner: patching). Each test fails on main
for the reason given."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from helpers.lm import tiny_gpt2

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


def _lm_case():
    model = tiny_gpt2().eval()
    clean, corrupt = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[3, 4, 7, 6]])
    return model, clean, corrupt, lambda out: out.logits[:, -1, 5].sum()


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_arg_without_at_input_is_refused(fn):
    """User passes arg=5 (meaning an input of the block) but forgets at="input": the sweep patches
    the block's output, silently, and returns output values; hs.edit refuses the same call
    ("arg= selects an input; use it with at='input'"), so should patch_sweep/attribution_patch."""
    model, clean, corrupt, metric = _lm_case()
    with pytest.raises((ValueError, hs.PatchingError), match="at="):
        getattr(hs, fn)(model, clean, corrupt, metric, ["transformer.h.1"], arg=5)


def test_float_arg_is_refused_not_read_as_the_first_input():
    """User passes arg=1.0 with at="input": the sweep silently patches input 0 (its values equal
    arg=0's, where arg=1 raises "input 1 ... holds no tensor"); a non-int, non-str arg should raise
    naming arg=."""
    model, clean, corrupt, metric = _lm_case()
    with pytest.raises((TypeError, ValueError, hs.PatchingError), match="arg"):
        hs.patch_sweep(model, clean, corrupt, metric, ["transformer.h.1"], at="input", arg=1.0)
