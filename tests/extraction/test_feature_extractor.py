"""``FeatureExtractor``: the features it returns equal torchvision's FX feature extractor and a
hand-written forward; it stops after the last requested layer and stays trainable through."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torchvision.models.feature_extraction import create_feature_extractor

import hookscope as hs


def _resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


def test_feature_extractor_equals_fx_resnet18():
    model = _resnet18()
    x = torch.randn(2, 3, 64, 64)
    for layers in (["layer2"], ["layer4", "avgpool"]):
        fx = create_feature_extractor(model, return_nodes=layers)
        ours = hs.FeatureExtractor(model, layers)
        got, want = ours(x), fx(x)
        assert list(got) == layers
        for n in layers:
            assert torch.equal(got[n], want[n])
        assert hs.hooks_on(model) == []  # hooks exist only during a call


def test_feature_extractor_stops_early_and_backpropagates():
    model = _resnet18()

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("the forward pass went past the last requested layer")

    model.layer4 = Boom()
    fx = hs.FeatureExtractor(model, ["layer2", "layer3"])
    x = torch.randn(1, 3, 64, 64, requires_grad=True)
    feats = fx(x)
    feats["layer3"].sum().backward()  # detach=False by default: trainable through
    assert x.grad is not None and x.grad.abs().sum() > 0
    # a layer that never runs is a clear error, not a silent empty dict
    fx_bad = hs.FeatureExtractor(model, ["layer2", "avgpool"], stop=False)
    with pytest.raises(AssertionError, match="went past"):
        fx_bad(x)


def test_extract_layer4_and_avgpool():
    model = _resnet18()
    x = torch.randn(2, 3, 64, 64)
    feats = hs.FeatureExtractor(model, ["layer4", "avgpool"])(x)
    m = model
    h = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    l4 = m.layer4(m.layer3(m.layer2(m.layer1(h))))
    assert torch.equal(feats["layer4"], l4)
    assert torch.equal(feats["avgpool"], m.avgpool(l4))
