"""Audit findings for apply_checkpointing (owner: memory). Each test fails on main (and on the
memory branch) for the reason given."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.skip(reason="audit finding, not yet fixed")


class _KeepsMaps(nn.Module):
    """Stores each call's activation in a list (as models that keep attention maps to plot do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.maps: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.maps.append(y.detach())
        return y.relu()


@pytest.mark.parametrize("nested", [False, True])
def test_checkpointed_forward_that_appends_to_a_list_appends_once_per_step(nested):
    """User checkpoints a module whose forward appends its activation to self.maps (attention
    maps kept for plotting): after one training step the list holds 2 entries (the recompute
    appended again), silently; it should hold 1, as without checkpointing (the guide says a
    recompute replays its call, plain attributes included), or the module should be refused."""
    torch.manual_seed(0)
    inner = _KeepsMaps()
    net = nn.Sequential(nn.Sequential(inner, nn.Linear(8, 8)) if nested else inner, nn.Linear(8, 1))
    handle = hs.apply_checkpointing(net, ["0"])
    try:
        net(torch.randn(4, 8)).sum().backward()
    finally:
        handle.remove()
    assert len(inner.maps) == 1


def test_memory_profile_under_inference_mode_names_inference_mode():
    """User calls hs.memory_profile inside torch.inference_mode() (e.g. an eval loop): the error
    says "no tensor in the model's output requires grad ... check requires_grad of the parameters,
    or pass loss_fn=", neither of which helps; it should name torch.inference_mode() and say to
    call it outside (as GradCAM's error does)."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(hs.HookscopeError, match="inference_mode"), torch.inference_mode():
        hs.memory_profile(net, torch.randn(3, 4))
