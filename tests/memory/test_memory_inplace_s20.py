"""memory_profile and a tensor changed in place after autograd saved it: with a pack hook in place
autograd skips its version check, so the profile must make it (a plain step raises)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.memory._saved import SavedTensorChangedError

PLAIN = "modified by an inplace operation"


class Saver(nn.Module):
    """``exp`` saves its result for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).exp()


class Bump(nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y.add_(1)  # changes what Saver's exp saved
        return y * 2


class SameLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).exp()
        y.add_(1)
        return y * 2


def _plain_step_raises(model: nn.Module, x: torch.Tensor) -> None:
    with pytest.raises(RuntimeError, match=PLAIN):
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backward_peak", [False, True])
def test_change_in_another_layer_raises_naming_saver_and_writer(backward_peak: bool) -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(Saver(), Bump()), torch.randn(3, 4)
    _plain_step_raises(model, x)  # the reference: a plain training step
    with pytest.raises(SavedTensorChangedError) as got:
        hs.memory_profile(model, x, backward_peak=backward_peak)
    msg = str(got.value)
    assert isinstance(got.value, RuntimeError) and isinstance(got.value, hs.HookscopeError)
    assert "layer '0' saved for backward" in msg and "by '1'" in msg
    assert "torch.float32 [3, 4]" in msg and "version 0, now 1" in msg
    assert "y = y + 1" in msg and "clone" in msg
    assert all(p.grad is None for p in model.parameters())  # the step left nothing behind


def test_change_in_the_same_layer_and_in_loss_fn() -> None:
    torch.manual_seed(0)
    model, x = SameLayer(), torch.randn(3, 4)
    _plain_step_raises(model, x)
    with pytest.raises(SavedTensorChangedError, match="layer '<root>' saved.* by '<root>'"):
        hs.memory_profile(model, x)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        out.mul_(3)  # changes the result Saver's exp saved
        return out.sum()

    model2 = nn.Sequential(Saver())
    with pytest.raises(RuntimeError, match=PLAIN):
        loss_fn(model2(x)).backward()
    model2.zero_grad(set_to_none=True)
    with pytest.raises(SavedTensorChangedError, match="layer '0' saved.* by the loss"):
        hs.memory_profile(model2, x, loss_fn=loss_fn)


def test_in_place_writes_a_plain_step_accepts_still_profile() -> None:
    """ReLU(inplace=True) after a Linear, and ``relu_`` of a result autograd saves after the
    write: a plain step runs, so does the profile, with the same figures as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the reference runs
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    prof = hs.memory_profile(model, x, backward_peak=True)
    # Linear 0 saves its input (48 bytes), ReLU its output (96), Linear 2 the same storage
    assert (prof["0"].saved_bytes, prof["1"].saved_bytes, prof.total_saved_bytes) == (48, 96, 144)
    model(x).sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    model.zero_grad(set_to_none=True)
