"""Audit findings for hs.compare (owner: compare). Each test fails on main for the reason given."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.skip(reason="audit finding, not yet fixed")


def test_compare_with_loss_fn_under_inference_mode_is_a_clear_error():
    """User calls hs.compare(a, b, x, loss_fn=...) inside torch.inference_mode(): PyTorch's raw
    RuntimeError "element 0 of tensors does not require grad and does not have a grad_fn"; it
    should be a CompareError naming torch.inference_mode() (loss_fn needs a backward)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    b = copy.deepcopy(a)
    with pytest.raises(hs.CompareError, match="inference_mode"), torch.inference_mode():
        hs.compare(a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
