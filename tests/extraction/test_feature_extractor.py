"""``FeatureExtractor``: the features it returns equal torchvision's FX feature extractor and a
hand-written forward; it stops after the last requested layer and stays trainable through."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision
from torchvision.models.feature_extraction import create_feature_extractor

import hookscope as hs
from helpers.common import RESNET34_RESIDUAL_SITES as RESNET_LAYERS
from helpers.common import resnet34_with_fx_features


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


@pytest.fixture(scope="module")
def resnet34():
    return resnet34_with_fx_features()


def test_feature_extractor_resnet34_equals_fx_and_zero_copy_warns(resnet34):
    model, x, ref = resnet34
    with torch.no_grad():
        got = hs.FeatureExtractor(model, RESNET_LAYERS)(x)
    for n in RESNET_LAYERS:
        assert torch.equal(got[n], ref[n]), n
    with torch.no_grad(), pytest.warns(hs.InPlaceModifiedWarning, match="layer2.1.bn2"):
        zero = hs.FeatureExtractor(model, RESNET_LAYERS, clone=False)(x)
    assert not torch.equal(zero["layer2.1.bn2"], ref["layer2.1.bn2"])
    # training through it (detach=False): the copy carries the gradient to the layer's output
    fx = hs.FeatureExtractor(model, ["layer2.1.bn2", "layer3"])
    xg = x.clone().requires_grad_()
    got = fx(xg)
    (g_hs,) = torch.autograd.grad(got["layer2.1.bn2"].sum(), xg)
    ref_fx = create_feature_extractor(model, return_nodes=["layer2.1.bn2", "layer3"])
    (g_ref,) = torch.autograd.grad(ref_fx(xg)["layer2.1.bn2"].sum(), xg)
    torch.testing.assert_close(g_hs, g_ref)


class Swallows(nn.Module):
    """A model that catches everything around an in-place layer (``except BaseException``: the
    early stop too), then changes its output."""

    broad: type[BaseException] = BaseException

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.b = nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        try:
            self.act(h)  # in place: its output is h itself
        except self.broad:
            pass
        h += 100.0
        return self.b(h)


def test_stop_layer_is_kept_without_a_copy_and_a_swallowed_stop_is_reported():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))
    x = torch.randn(2, 3)
    seen = []
    h = net[0].register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.no_grad():
            out = hs.FeatureExtractor(net, ["0"])(x)
    finally:
        h.remove()
    # the call that ends the forward needs no copy: nothing runs after it
    assert out["0"].data_ptr() == seen[0].data_ptr() and torch.equal(out["0"], net[0](x))
    # a model that swallows the stop signal runs on and changes the value: reported, not silent
    torch.manual_seed(0)
    m = Swallows()
    with torch.no_grad(), pytest.warns(hs.InPlaceModifiedWarning, match="'act' \\(call 0\\)"):
        got = hs.FeatureExtractor(m, ["act"])(x)
    assert torch.equal(got["act"], m.lin(x).clamp(min=0) + 100.0)
    # a model's own `except Exception:` does not catch the stop (a BaseException): exact value
    m.broad = Exception
    with torch.no_grad():
        got = hs.FeatureExtractor(m, ["act"])(x)
    assert torch.equal(got["act"], m.lin(x).clamp(min=0))


@pytest.mark.parametrize("stop", [True, False])
def test_a_layer_that_runs_twice_is_refused_not_one_call_by_chance(stop):
    """A module called twice before the forward ends: stop=True returned one call and
    stop=False the other, neither said so; refused naming the layer and hs.capture."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.sh, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.sh(self.sh(x)))

    with pytest.raises(hs.HookscopeError, match="'sh' of Twice ran more than once"):
        hs.FeatureExtractor(Twice(), ["sh", "out"], stop=stop)(torch.randn(2, 4))
