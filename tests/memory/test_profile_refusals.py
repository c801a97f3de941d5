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


def test_to_text_narrower_than_the_table_raises_instead_of_cutting_numbers_off():
    """``to_text(width=)`` used to cut every line at ``width``, silently dropping the right-hand
    columns' digits; now a width that cannot hold the table raises with the width that does."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    prof = hs.memory_profile(net, torch.randn(4, 8))
    lines = prof.to_text(width=200).splitlines()
    table = [line for line in lines[1:] if not line.startswith(("*", "peak", "compiled"))]
    need = len(lines[2])  # the rule under the header spans the table
    assert max(len(line) for line in table[: len(prof.rows) + 2]) <= need
    assert prof.to_text(width=need) == prof.to_text(width=200)
    with pytest.raises(ValueError, match=f"width={need - 1} is narrower than the table \\({need} "):
        prof.to_text(width=need - 1)
    with pytest.raises(TypeError, match="width= must be an int"):
        prof.to_text(width="80")
