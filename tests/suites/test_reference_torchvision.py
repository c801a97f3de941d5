"""Captured features equal torchvision's FX feature extractor; captured gradients equal
``torch.autograd.grad`` at the same layers (random weights, eval mode)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torchvision.models.feature_extraction import create_feature_extractor

import hookscope as hs

# (model name, layers to compare, input size). Layers whose output a later in-place op modifies
# (e.g. a conv followed by ReLU(inplace=True)) are covered separately in test_pitfalls.py.
CASES = [
    ("resnet18", ["conv1", "layer1", "layer2.1.conv2", "layer3", "layer4", "avgpool", "fc"], 64),
    ("resnet50", ["layer1", "layer2", "layer3.2.conv3", "layer4", "avgpool", "fc"], 64),
    ("vgg11", ["features.2", "features.5", "features.10", "avgpool", "classifier.6"], 64),
    (
        "mobilenet_v3_small",
        ["features.0", "features.3", "features.12", "avgpool", "classifier.3"],
        64,
    ),
    (
        "vit_b_16",
        [
            "conv_proj",
            "encoder.layers.encoder_layer_3",
            "encoder.layers.encoder_layer_11.mlp",
            "encoder.ln",
            "heads.head",
        ],
        224,
    ),
]
SLOW = {"vit_b_16", "vgg11", "resnet50"}


def _params(name):
    return [
        pytest.param(*c, marks=pytest.mark.slow if c[0] in SLOW else ())
        for c in CASES
        if c[0] == name
    ]


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None).eval()


@pytest.mark.parametrize(("name", "layers", "size"), [p for c in CASES for p in _params(c[0])])
def test_features_and_gradients_equal_fx_and_autograd(name, layers, size):
    model = _build(name)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    final = layers[-1]

    # Reference: FX feature extractor and autograd.grad of a fixed random projection of the output.
    fx = create_feature_extractor(model, return_nodes=layers)
    ref = fx(x)
    proj = torch.randn(ref[final].shape, generator=torch.Generator().manual_seed(2))
    loss_ref = (ref[final] * proj).sum()
    ref_grads = torch.autograd.grad(loss_ref, [ref[n] for n in layers])

    with hs.capture(model, layers, grads=True) as cap:
        out = model(x)
        (out * proj).sum().backward()

    for n, g in zip(layers, ref_grads):
        assert torch.equal(cap[n], ref[n].detach()), f"{name}:{n} features differ from FX"
        torch.testing.assert_close(
            cap.grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{name}:{n} grads: {m}"
        )
    # the model is left as found
    assert not model.training
    assert hs.hooks_on(model) == []
    model.zero_grad(set_to_none=True)
