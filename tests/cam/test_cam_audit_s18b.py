"""Audit s18b of the CAM methods: maps equal those of a reference model, or the call is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs


class Net(nn.Module):
    """A small CNN; ``kind`` says what it returns besides (or around) its logits."""

    def __init__(self, kind: str = "logits") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        pooled = self.conv(x).relu().mean(dim=(2, 3))
        logits = self.head(pooled)
        if self.kind == "features_first":
            return pooled, logits
        if self.kind == "with_lengths":  # one floating tensor: no doubt which are the logits
            return logits, torch.full((x.shape[0],), 8)
        if self.kind == "segmentation_dict":  # torchvision's segmentation models: "out", "aux"
            return {"aux": pooled, "out": logits}
        return logits


@pytest.fixture
def x():
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["gradcam", "scorecam"])
@pytest.mark.parametrize("target", [2, None])
def test_a_class_index_on_an_output_holding_several_tensors_is_refused(method, target, x):
    """A model returning ``(features, logits)``: the class index was applied to the features
    (the output's first tensor), silently: the map of another score entirely."""
    net = Net("features_first").eval()
    with pytest.raises(hs.CAMError, match=r"2 floating tensors.*out\[0\] \(2, 6\).*target=fn"):
        hs.get_cam(method)(net, "conv")(x, target=target)
    # the fix the message gives: a function picking the logits gives the logits model's map
    want = hs.get_cam(method)(Net().eval(), "conv")(x, target=2)
    got = hs.get_cam(method)(net, "conv")(x, target=lambda out: out[1][:, 2])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["with_lengths", "segmentation_dict"])
def test_outputs_whose_logits_are_unambiguous_keep_class_indices(kind, x):
    want = hs.GradCAM(Net().eval(), "conv")(x, target=[1, 3])
    got = hs.GradCAM(Net(kind).eval(), "conv")(x, target=[1, 3])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
