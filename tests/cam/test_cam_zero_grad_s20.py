"""A target whose score does not depend on the layer (its gradient there is zero everywhere) gave
an all-zero map without a word. On CPU it is now warned of, naming the layer and the samples; the
map stays what Grad-CAM computes (all zeros, as a hand-written Grad-CAM gives). On CUDA it is not
checked (the check would synchronise with the host, which the CAM contract forbids)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.core._errors import HookscopeWarning


class TwoHeads(nn.Module):
    """Classes 0-1 are scored from ``conv``'s output, classes 2-3 from another branch: ``conv``
    does not influence the scores of classes 2 and 3 (its gradient for them is exactly zero)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.other = nn.Conv2d(3, 4, 3, padding=1)
        self.head_a = nn.Linear(4, 2)
        self.head_b = nn.Linear(4, 2)

    def rest(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a = self.head_a(F.relu(h).mean((2, 3)))
        b = self.head_b(F.relu(self.other(x)).mean((2, 3)))
        return torch.cat([a, b], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.conv(x), x)


def hand_gradcam(net: TwoHeads, x: torch.Tensor, target: list[int]) -> torch.Tensor:
    """Grad-CAM written out: channel weights = mean gradient, ReLU, upsample, min-max."""
    h = net.conv(x).detach().requires_grad_()
    out = net.rest(h, x)
    (g,) = torch.autograd.grad(out[torch.arange(len(target)), target].sum(), h)
    m = (g.mean((2, 3), keepdim=True) * h).sum(1).clamp_min(0).detach()
    m = m - m.amin((1, 2), keepdim=True)
    return m / (1e-7 + m.amax((1, 2), keepdim=True))


def test_zero_gradient_warns_naming_the_layer_and_the_map_is_grad_cams_zeros():
    net, x = TwoHeads().eval(), torch.randn(2, 3, 8, 8)
    want = hand_gradcam(net, x, [3, 3])
    assert torch.equal(want, torch.zeros(2, 8, 8))
    with pytest.warns(HookscopeWarning) as rec:
        cam = hs.GradCAM(net, "conv")(x, target=3)
    assert torch.equal(cam, want)
    text = " ".join(str(w.message) for w in rec)
    assert "'conv'" in text and "zero" in text and "gradient" in text, text
    assert rec[0].filename == __file__  # points at the caller's line
    assert not net.conv._forward_hooks and not net._forward_hooks


def test_only_the_samples_with_zero_gradient_are_named():
    net, x = TwoHeads().eval(), torch.randn(3, 3, 8, 8)
    with pytest.warns(HookscopeWarning, match=r"sample\(s\) 1\b") as rec:
        cam = hs.GradCAM(net, "conv")(x, target=[0, 2, 1])
    assert "sample(s) 1 " in str(rec[0].message) or "sample(s) 1:" in str(rec[0].message)
    assert torch.equal(cam[1], torch.zeros(8, 8))
    assert torch.allclose(cam, hand_gradcam(net, x, [0, 2, 1]), atol=1e-4)


@pytest.mark.parametrize("method", ["gradcam", "gradcam++", "xgradcam", "hirescam", "layercam"])
def test_a_layer_on_the_path_does_not_warn(method):
    net, x = TwoHeads().eval(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.get_cam(method)(net, "conv")(x, target=[0, 1])
        hs.get_cam(method)(net, "other")(x, target=[2, 3])
    with pytest.warns(HookscopeWarning, match="'other'"):
        hs.get_cam(method)(net, "other")(x, target=[0, 1])
