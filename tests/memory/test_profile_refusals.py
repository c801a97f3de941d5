"""memory_profile refuses, naming the cause, a step that cannot run a backward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs


def test_memory_profile_under_inference_mode_names_inference_mode():
    """hs.memory_profile called inside torch.inference_mode() (an eval loop) raises naming
    torch.inference_mode() and saying to call it outside, not requires_grad or loss_fn=."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with (
        pytest.raises(
            hs.HookscopeError, match=r"torch\.inference_mode\(\) forbids; call it outside"
        ),
        torch.inference_mode(),
    ):
        hs.memory_profile(net, torch.randn(3, 4))


def test_memory_profile_under_no_grad_names_no_grad():
    """hs.memory_profile called inside torch.no_grad() raises naming torch.no_grad()."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(hs.HookscopeError, match=r"torch\.no_grad\(\)"), torch.no_grad():
        hs.memory_profile(net, torch.randn(3, 4))
