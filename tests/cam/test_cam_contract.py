"""The contract every registered CAM method keeps: shape, range, dtype, device, batch independence,
target forms, nested outputs, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs

# these tests give every method a target; EigenCAM ignores it, which it says (tested in
# test_cam_eigencam_target_s20.py)
pytestmark = pytest.mark.filterwarnings("ignore:EigenCAM. target=.* is ignored")

METHODS = sorted(hs.cam_methods())


class Net(nn.Module):
    """A small CNN with an in-place ReLU after the target layer; output as tensor, tuple or dict."""

    def __init__(self, kind: str = "tensor") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.act2 = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor):
        f = self.act2(self.conv2(self.act1(self.conv1(x))))
        logits = self.head(f.mean(dim=(2, 3)))
        if self.kind == "tuple":
            return logits, f
        if self.kind == "dict":
            return {"features": f, "logits": logits}
        return logits


@pytest.fixture
def x():
    return torch.randn(3, 3, 12, 16, generator=torch.Generator().manual_seed(0))


def test_registry_has_the_seven_methods():
    assert METHODS == [
        "eigencam",
        "gradcam",
        "gradcam++",
        "hirescam",
        "layercam",
        "scorecam",
        "xgradcam",
    ]
    assert hs.get_cam("GradCAM") is hs.GradCAM
    assert hs.get_cam("grad_cam_pp") is hs.GradCAMPlusPlus
    assert hs.get_cam("GradCAMPlusPlus") is hs.GradCAMPlusPlus
    assert all(issubclass(c, hs.CAM) for c in hs.cam_methods().values())


def test_unknown_method_suggests():
    with pytest.raises(hs.CAMError, match="did you mean gradcam"):
        hs.get_cam("gradcm")


@pytest.mark.parametrize("method", METHODS)
def test_shape_range_dtype_device(method, x):
    net = Net().eval()
    cam = hs.get_cam(method)(net, "conv2")(x, target=1)
    assert cam.shape == (3, 12, 16)
    assert cam.dtype == torch.float32 and cam.device == x.device
    assert torch.isfinite(cam).all()
    assert cam.min() >= 0 and cam.max() <= 1
    raw = hs.get_cam(method)(net, "conv2", raw=True)(x, target=1)
    assert raw.shape == (3, 6, 8)
    signed = hs.get_cam(method)(net, "conv2", relu=False)(x, target=1)
    assert signed.min() >= 0 and signed.max() <= 1


@pytest.mark.parametrize("method", METHODS)
def test_batch_independence(method, x):
    net = Net().eval()
    cam = hs.get_cam(method)(net, "conv2")
    full = cam(x, target=[0, 1, 2])
    for i in range(3):
        alone = cam(x[i : i + 1], target=[i])
        torch.testing.assert_close(full[i : i + 1], alone, atol=1e-5, rtol=0)
    other = torch.cat([x[:1], torch.randn(2, 3, 12, 16)])
    torch.testing.assert_close(cam(other, target=[0, 4, 4])[0], full[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_target_forms_agree(method, x):
    net = Net().eval()
    cam = hs.get_cam(method)(net, "conv2")
    pred = net(x).argmax(1)
    by_none = cam(x)
    torch.testing.assert_close(by_none, cam(x, target=pred.tolist()))
    torch.testing.assert_close(by_none, cam(x, target=pred))
    torch.testing.assert_close(cam(x, target=2), cam(x, target=[2, 2, 2]))
    torch.testing.assert_close(
        cam(x, target=2), cam(x, target=lambda out: out[:, 2]), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("method", ["gradcam", "scorecam", "eigencam"])
def test_nested_outputs(kind, method, x):
    plain = hs.get_cam(method)(Net().eval(), "conv2")(x, target=3)
    net = Net(kind).eval()
    if kind == "dict":  # the "logits" entry is found by name
        torch.testing.assert_close(hs.get_cam(method)(net, "conv2")(x, target=3), plain)
    fn = (lambda out: out[0][:, 3]) if kind == "tuple" else (lambda out: out["logits"][:, 3])
    torch.testing.assert_close(
        hs.get_cam(method)(net, "conv2")(x, target=fn), plain, atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("method", ["gradcam", "layercam"])
def test_frozen_model_still_gets_gradients(method, x):
    net = Net().eval()
    ref = hs.get_cam(method)(net, "conv2")(x, target=2)
    net.requires_grad_(False)  # e.g. a fine-tuning setup: only the layer output needs a gradient
    torch.testing.assert_close(hs.get_cam(method)(net, "conv2")(x, target=2), ref)
    assert not any(p.requires_grad for p in net.parameters())


def test_inplace_model_equals_out_of_place(x):
    net = Net().eval()
    twin = Net().eval()
    twin.load_state_dict(net.state_dict())
    twin.act1.inplace = twin.act2.inplace = False
    for method in METHODS:
        for layer in ("conv1", "conv2"):
            a = hs.get_cam(method)(net, layer, raw=True, relu=False)(x, target=4)
            b = hs.get_cam(method)(twin, layer, raw=True, relu=False)(x, target=4)
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"{method} {layer}")


def test_several_layers_mean_and_raw_sizes(x):
    net = Net().eval()
    both = hs.GradCAM(net, ["conv1", "conv2"])(x, target=1)

    def minmax(m):
        m = m - m.flatten(1).amin(1)[:, None, None]
        return m / (m.flatten(1).amax(1)[:, None, None] + 1e-7)

    ups = []
    for layer in ("conv1", "conv2"):  # each layer: normalise at its resolution, upsample; then mean
        raw = minmax(hs.GradCAM(net, layer, raw=True)(x, target=1))
        ups.append(
            torch.nn.functional.interpolate(raw[:, None], size=(12, 16), mode="bilinear")[:, 0]
        )
    torch.testing.assert_close(both, minmax((ups[0] + ups[1]) / 2), atol=1e-6, rtol=0)
    with pytest.raises(hs.CAMError, match="equal map sizes"):
        hs.GradCAM(net, ["conv1", "conv2"], raw=True)(x, target=1)


def test_segmentation_output_and_target_errors(x):
    seg = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 3, 1)
    ).eval()
    a = hs.GradCAM(seg, "0")(x, target=2)  # class 2 summed over the pixels
    b = hs.GradCAM(seg, "0")(x, target=lambda out: out[:, 2].sum(dim=(1, 2)))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(hs.CAMError, match="predicted class"):
        hs.GradCAM(seg, "0")(x)
    net = Net().eval()
    with pytest.raises(hs.CAMError, match="2 targets for a batch of 3"):
        hs.GradCAM(net, "conv2")(x, target=[1, 2])
    with pytest.raises(hs.CAMError, match="class 7 out of range"):
        hs.GradCAM(net, "conv2")(x, target=7)


def test_layer_errors(x):
    net = Net().eval()
    with pytest.raises(hs.LayerNotFoundError, match="conv2"):
        hs.GradCAM(net, "conv3")
    with pytest.raises(hs.ReshapeError, match="no spatial dimensions"):
        hs.GradCAM(net, "head")(x, target=0)

    class Skips(Net):
        def forward(self, x):
            return self.head(self.conv2(self.conv1(x)).mean(dim=(2, 3)))

    with pytest.raises(hs.CAMError, match="never ran"):
        hs.GradCAM(Skips().eval(), "act1")(x, target=0)


def test_reused_module_is_refused_not_read_at_its_last_call(x):
    """It used its last call without saying so (docs/pitfalls.md §9: a store with one slot per
    module keeps only the last call silently); a CAM needs one activation: refused by name."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(self.conv(self.conv(x)).mean(dim=(2, 3)))

    net = Twice().eval()
    with pytest.raises(hs.CAMError, match="'conv' ran more than once"):
        hs.GradCAM(net, "conv", raw=True, relu=False)(x, target=1)


def test_memory_bound_scorecam_batches(x):
    net = Net().eval()
    # a plain hook written by hand counts the CAM's own forwards (a capture open around the CAM
    # does not see them: they are the CAM's internal runs)
    calls: list[int] = []
    handle = net.conv1.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    try:
        hs.ScoreCAM(net, "conv2", batch_size=3)(x[:1], target=0)
        # one forward to read the activation and check the target, then 8 channels in batches of 3
        assert calls == [1, 3, 3, 2]
        calls.clear()
        hs.ScoreCAM(net, "conv2", batch_size=3)(x[:1], target=lambda out: out[:, 0])
        assert calls == [1, 3, 3, 2]
    finally:
        handle.remove()
    with hs.capture(net, "conv1", clone=True) as cap:
        hs.ScoreCAM(net, "conv2", batch_size=3)(x[:1], target=0)
    assert cap.calls("conv1") == []
    with pytest.raises(hs.CAMError, match="one score per row"):
        hs.ScoreCAM(net, "conv2", batch_size=3)(x[:1], target=lambda out: out[:, 0].sum())
    with pytest.raises(hs.CAMError, match="class 9 out of range"):
        hs.ScoreCAM(net, "conv2")(x, target=9)
