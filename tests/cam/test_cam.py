"""CAM values against independent references: pytorch-grad-cam, Captum, and a hand computation.

How the comparison with pytorch-grad-cam is made: it computes each layer's map, applies a ReLU,
min-max normalises each map (``(m - min) / (max + 1e-7)``), resizes it with ``cv2.resize``
(``INTER_LINEAR``, i.e. bilinear with half-pixel centres, the same sampling as
``F.interpolate(..., align_corners=False)``: the two agree to ~2e-7 on float32), averages layers
and normalises again. hookscope does the same steps on the device, so the full-resolution maps
are compared directly, per pixel, within 1e-4. pytorch-grad-cam's hooks store the activation
without copying it, so on a model with ``ReLU(inplace=True)`` after the target layer it reads the
post-ReLU values; we therefore compare hookscope on the in-place model with pytorch-grad-cam on
an out-of-place twin with the same weights (the values the layer really produced).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookscope as hs

pgc = pytest.importorskip("pytorch_grad_cam")
torchvision = pytest.importorskip("torchvision")
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402

# these tests give every method a target; EigenCAM ignores it, which it says (tested in
# test_cam_eigencam_target_s20.py)
pytestmark = pytest.mark.filterwarnings("ignore:EigenCAM. target=.* is ignored")

REFERENCE = {
    "gradcam": pgc.GradCAM,
    "gradcam++": pgc.GradCAMPlusPlus,
    "xgradcam": pgc.XGradCAM,
    "hirescam": pgc.HiResCAM,
    "layercam": pgc.LayerCAM,
    "eigencam": pgc.EigenCAM,
}


def small_cnn(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 6),
    ).eval()


def _out_of_place(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return twin


def reference_cam(
    name: str, model: nn.Module, layers: list[nn.Module], x: torch.Tensor, targets, **kw
) -> torch.Tensor:
    """Run pytorch-grad-cam (on a copy, since it calls model.eval() and fills .grad) and release its hooks."""
    model = copy.deepcopy(model)
    with REFERENCE[name](model, layers(model), **kw) as ref:
        out = ref(x, None if targets is None else [ClassifierOutputTarget(t) for t in targets])
    del ref
    return torch.from_numpy(out)


@pytest.fixture(scope="module")
def resnet18():
    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=10).eval()
    # random BN statistics so the activations are not degenerate
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return m


@pytest.fixture(scope="module")
def image64():
    return torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def eigen_sign_corrected(monkeypatch):
    """pytorch-grad-cam's EigenCAM leaves the SVD sign to LAPACK; hookscope fixes it (larger
    magnitude positive, Seg-Eigen-CAM eq. 13), which is what pytorch-grad-cam's own
    ``get_2d_projection_with_sign_correction`` computes: compare with that."""
    import pytorch_grad_cam.eigen_cam as ec
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection_with_sign_correction

    monkeypatch.setattr(ec, "get_2d_projection", get_2d_projection_with_sign_correction)


@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_resnet18_equals_pytorch_grad_cam(method, resnet18, image64, eigen_sign_corrected):
    x, targets = image64[:1], [3]
    ours = hs.get_cam(method)(resnet18, "layer4")(x, target=targets)
    ref = reference_cam(method, resnet18, lambda m: [m.layer4], x, targets)
    assert ours.shape == ref.shape == (1, 48, 48)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_inplace_cnn_equals_pytorch_grad_cam_on_out_of_place_twin(method, eigen_sign_corrected):
    model = small_cnn(inplace=True)
    twin = _out_of_place(model)
    x = torch.randn(3, 3, 20, 20, generator=torch.Generator().manual_seed(2))
    # layer "2" is followed by BatchNorm and then an in-place ReLU; "5" directly by ReLU(inplace=True)
    for layer in ("2", "5"):
        ours = hs.get_cam(method)(model, layer)(x, target=[0, 2, 5])
        ref = reference_cam(method, twin, lambda m, layer=layer: [m[int(layer)]], x, [0, 2, 5])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        # and equal to hookscope on the out-of-place model
        torch.testing.assert_close(
            ours, hs.get_cam(method)(twin, layer)(x, target=[0, 2, 5]), atol=1e-6, rtol=0
        )


def test_several_layers_average_like_pytorch_grad_cam(resnet18, image64):
    ours = hs.GradCAM(resnet18, ["layer3", "layer4"])(image64, target=[1, 2])
    ref = reference_cam("gradcam", resnet18, lambda m: [m.layer3, m.layer4], image64, [1, 2])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_predicted_class_is_the_default(resnet18, image64):
    ours = hs.GradCAM(resnet18, "layer3")(image64)
    ref = reference_cam("gradcam", resnet18, lambda m: [m.layer3], image64, None)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("relu", [False, True])
def test_raw_gradcam_equals_captum_layergradcam(relu, resnet18, image64):
    captum_attr = pytest.importorskip("captum.attr")
    ours = hs.GradCAM(resnet18, "layer3", raw=True, relu=relu)(image64, target=[4, 9])
    model = copy.deepcopy(resnet18)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="captum")
        ref = captum_attr.LayerGradCam(model, model.layer3).attribute(
            image64, target=[4, 9], relu_attributions=relu
        )
    assert ours.shape == (2, 3, 3)
    torch.testing.assert_close(ours, ref[:, 0], atol=1e-5, rtol=1e-5)


def test_upsampled_gradcam_equals_captum_interpolate(resnet18, image64):
    captum_attr = pytest.importorskip("captum.attr")
    raw = hs.GradCAM(resnet18, "layer4", raw=True)(image64, target=[4, 9])
    model = copy.deepcopy(resnet18)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="captum")
        ref = captum_attr.LayerGradCam(model, model.layer4).attribute(
            image64, target=[4, 9], relu_attributions=True
        )
        up = captum_attr.LayerAttribution.interpolate(ref, (48, 48), interpolate_mode="bilinear")
    torch.testing.assert_close(raw, ref[:, 0], atol=1e-5, rtol=1e-5)
    ours = hs.GradCAM(resnet18, "layer4")(image64, target=[4, 9])
    # normalisation commutes with bilinear upsampling up to its own min/max
    flat = up.flatten(1)
    lo, hi = flat.amin(1)[:, None, None, None], flat.amax(1)[:, None, None, None]
    torch.testing.assert_close(ours, ((up - lo) / (hi - lo))[:, 0], atol=1e-4, rtol=0)


def test_hand_computed_map_on_tiny_conv_net():
    """conv 1->2 channels (3x3, no padding) on 4x4 -> 2x2 maps, global average pool, linear.

    score = sum_c v_c * mean(A_c), so dS/dA_c = v_c / 4 everywhere and Grad-CAM is
    relu(sum_c (v_c / 4) * A_c).
    """
    conv = nn.Conv2d(1, 2, 3, bias=False)
    fc = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, 1, 1] = 1.0  # channel 0: the centre pixel of each 3x3 window
        conv.weight[1, 0, 0, 0] = 1.0  # channel 1: the top-left pixel
        fc.weight.copy_(torch.tensor([[2.0, -4.0]]))
    net = nn.Sequential(conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), fc).eval()
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    # A_0 = x[1:3, 1:3] = [[5, 6], [9, 10]];  A_1 = x[0:2, 0:2] = [[0, 1], [4, 5]]
    # weights: 2/4 = 0.5 and -4/4 = -1 -> 0.5*A_0 - A_1 = [[2.5, 2], [0.5, 0]]
    expected = torch.tensor([[[2.5, 2.0], [0.5, 0.0]]])
    raw = hs.GradCAM(net, "0", raw=True)(x, target=0)
    assert torch.equal(raw, expected)
    full = hs.GradCAM(net, "0")(torch.nn.functional.pad(x, (0, 0, 0, 0)), target=0)
    assert full.shape == (1, 4, 4)
    # HiResCAM: sum_c g_c * A_c with the same g -> the same map here
    assert torch.equal(hs.HiResCAM(net, "0", raw=True)(x, target=0), expected)
    # LayerCAM: relu(g) * A: only channel 0 (positive weight) contributes -> 0.5 * A_0
    assert torch.equal(
        hs.LayerCAM(net, "0", raw=True)(x, target=0), torch.tensor([[[2.5, 3.0], [4.5, 5.0]]])
    )


def test_scorecam_equals_pytorch_grad_cam_on_small_cnn(capsys):
    model = small_cnn(inplace=False)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    ours = hs.ScoreCAM(model, "5", batch_size=5)(x, target=[1, 4])
    ref_model = copy.deepcopy(model)
    with pgc.ScoreCAM(ref_model, [ref_model[5]]) as ref:
        out = ref(x, [ClassifierOutputTarget(1), ClassifierOutputTarget(4)])
    del ref
    torch.testing.assert_close(ours, torch.from_numpy(out), atol=1e-4, rtol=0)
    # the batch size only bounds memory
    torch.testing.assert_close(
        ours, hs.ScoreCAM(model, "5", batch_size=64)(x, target=[1, 4]), atol=1e-6, rtol=0
    )


def test_eigencam_projection_is_the_first_principal_component(resnet18, image64):
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection

    with torch.no_grad(), hs.capture(resnet18, "layer3") as cap:
        resnet18(image64)
    ref = torch.from_numpy(get_2d_projection(cap["layer3"].numpy()))
    ours = hs.EigenCAM(resnet18, "layer3", raw=True, relu=False)(image64)
    for i in range(2):  # equal up to the SVD's sign, which hookscope fixes
        sign = 1.0 if (ours[i] * ref[i]).sum() >= 0 else -1.0
        torch.testing.assert_close(ours[i], sign * ref[i], atol=1e-4, rtol=1e-4)
        assert ours[i].max().abs() >= ours[i].min().abs()


def test_no_gradient_before_the_layer_and_none_for_parameters():
    """Autograd records nothing before the target layer: the input image is never saved for
    backward (conv 0 would save it), and no parameter gets a .grad."""
    model = small_cnn(inplace=True)
    x = torch.randn(2, 3, 16, 16)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hs.GradCAM(model, "5")(x, target=1)
    assert saved, "the part after the layer is recorded"
    assert (2, 3, 16, 16) not in saved and (2, 8, 16, 16) not in saved
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("training", [False, True])
def test_model_left_as_found(training):
    model = small_cnn(inplace=True).train(training)
    model[0].weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    for method in hs.cam_methods().values():
        buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
        with (
            warnings.catch_warnings()
        ):  # train mode: batch statistics (tested in test_cam_model_state)
            warnings.simplefilter("ignore" if training else "error", hs.HookscopeWarning)
            method(model, "2")(torch.randn(2, 3, 16, 16), target=0 if method.needs_target else None)
        for k, v in buffers.items():
            assert torch.equal(model.state_dict()[k], v), k
        assert model.training is training  # hookscope never calls eval() or train()
        assert [p.requires_grad for p in model.parameters()] == flags
        assert all(p.grad is None for p in model.parameters())
        assert hs.hooks_on(model) == []
        assert torch.is_grad_enabled()


def test_grad_mode_restored_and_works_under_no_grad():
    model = small_cnn(inplace=True)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        a = hs.GradCAM(model, "5")(x, target=2)
        assert not torch.is_grad_enabled()
    torch.testing.assert_close(a, hs.GradCAM(model, "5")(x, target=2))
    with torch.inference_mode(), pytest.raises(hs.CAMError, match="inference_mode"):
        hs.GradCAM(model, "5")(x, target=2)


def test_repeated_calls_leave_no_hooks():
    model = small_cnn(inplace=True)
    cam = hs.GradCAM(model, "5")
    x = torch.randn(2, 3, 16, 16)
    for _ in range(10):
        cam(x, target=1)
    assert hs.hooks_on(model) == []


def test_outputs_are_comparable_numbers(resnet18, image64):
    cam = hs.GradCAM(resnet18, "layer4")(image64, target=[3, 7])
    assert np.isfinite(cam.numpy()).all()
    assert cam.dtype == torch.float32


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (not verified on CPU-only machines)"
)
@pytest.mark.parametrize(
    "method", ["gradcam", "gradcam++", "xgradcam", "hirescam", "layercam", "scorecam"]
)
def test_no_host_sync_on_cuda(method):
    model = small_cnn(inplace=True).cuda()
    x = torch.randn(3, 3, 16, 16, device="cuda")
    cam = hs.get_cam(method)(model, "5")
    cam(x)  # warm-up (lazy CUDA initialisation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = cam(x)
        out = cam(x, target=torch.tensor([1, 2, 3], device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.device == x.device


def test_autograd_graph_freed_after_the_call():
    """Nothing of the call's graph survives it (freed by reference counting, no gc needed)."""
    import weakref

    model = small_cnn(inplace=True)
    refs: list[weakref.ref] = []
    state = [id(t) for t in model.state_dict(keep_vars=True).values()]  # weights, BN statistics

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in state:
            refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cam = hs.GradCAM(model, "2")(torch.randn(2, 3, 16, 16), target=1)
    assert refs and all(r() is None for r in refs)
    assert cam.grad_fn is None and not cam.requires_grad
