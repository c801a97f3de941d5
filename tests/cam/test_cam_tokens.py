"""Token layers (ViT, Swin) and HuggingFace models: grids found without the user writing a reshape,
values equal to pytorch-grad-cam given the matching ``reshape_transform`` by hand."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.cam._tokens import to_grid

pgc = pytest.importorskip("pytorch_grad_cam")
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402


def reference(model, layer, x, targets, reshape_transform):
    model = copy.deepcopy(model)
    with pgc.GradCAM(model, [layer(model)], reshape_transform=reshape_transform) as ref:
        out = ref(x, [ClassifierOutputTarget(t) for t in targets])
    del ref
    return torch.from_numpy(out)


def tokens_to_grid(h, w, prefix):
    def fn(t):
        return t[:, prefix:].reshape(t.shape[0], h, w, t.shape[2]).permute(0, 3, 1, 2)

    return fn


# -- the rules ---------------------------------------------------------------------------------
def test_to_grid_rules():
    t = torch.arange(2 * 17 * 3, dtype=torch.float32).reshape(2, 17, 3)
    g = to_grid(t, image_hw=(64, 64))
    assert g.shape == (2, 3, 4, 4)
    assert torch.equal(g, tokens_to_grid(4, 4, 1)(t))  # class token dropped, row-major patches
    assert to_grid(torch.zeros(2, 16, 3), image_hw=(64, 64)).shape == (2, 3, 4, 4)
    assert to_grid(torch.zeros(2, 1 + 2 * 4, 3), image_hw=(32, 64)).shape == (
        2,
        3,
        2,
        4,
    )  # aspect ratio
    assert to_grid(torch.zeros(2, 7, 7, 96), image_hw=(224, 224)).shape == (
        2,
        96,
        7,
        7,
    )  # channels-last
    assert to_grid(torch.zeros(2, 96, 7, 7), image_hw=(224, 224)).shape == (2, 96, 7, 7)
    assert to_grid(torch.zeros(2, 21, 3), (4, 4)).shape == (2, 3, 4, 4)
    with pytest.raises(hs.ReshapeError, match=r"reshape=\(h, w\)"):
        to_grid(torch.zeros(2, 21, 3), image_hw=(64, 64))  # 4 register tokens + class token
    with pytest.raises(hs.ReshapeError, match="reshape="):
        to_grid(torch.zeros(2, 12, 3), image_hw=(64, 64))
    with pytest.raises(hs.ReshapeError, match="must return"):
        to_grid(torch.zeros(2, 16, 3), lambda t: t.sum())


# -- timm --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10, depth=3
    ).eval()


def test_timm_vit_without_reshape_equals_reference(timm_vit):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ours = hs.GradCAM(timm_vit, "blocks.2.norm1")(x, target=[1, 6])
    ref = reference(timm_vit, lambda m: m.blocks[2].norm1, x, [1, 6], tokens_to_grid(4, 4, 1))
    assert ours.shape == (2, 64, 64)
    assert ours.amax() > 0
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_timm_vit_variants():
    timm = pytest.importorskip("timm")
    x = torch.randn(1, 3, 64, 64)
    no_cls = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=64,
        num_classes=10,
        class_token=False,
        global_pool="avg",
        depth=2,
    ).eval()
    assert hs.GradCAM(no_cls, "blocks.1.norm1")(x).shape == (1, 64, 64)
    regs = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10, reg_tokens=4, depth=2
    ).eval()
    with pytest.raises(hs.ReshapeError, match="21 tokens"):
        hs.GradCAM(regs, "blocks.1.norm1")(x)
    assert hs.GradCAM(regs, "blocks.1.norm1", reshape=(4, 4))(x).shape == (1, 64, 64)


def test_timm_swin_channels_last():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    swin = timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        num_classes=10,
        img_size=64,
        window_size=4,
        embed_dim=24,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
    ).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ours = hs.GradCAM(swin, "layers.2")(x, target=[0, 3])
    ref = reference(swin, lambda m: m.layers[2], x, [0, 3], lambda t: t.permute(0, 3, 1, 2))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


# -- torchvision -------------------------------------------------------------------------------
def _check_torchvision_vit(vit, block: str, x, target: list[int], side: int) -> None:
    """GradCAM at the block's ``ln_1`` (a side x side grid of patches after the class token) equals
    the hand-written reference, and is not all zero."""
    ours = hs.GradCAM(vit, f"encoder.layers.{block}.ln_1")(x, target=target)
    ref = reference(
        vit,
        lambda m: getattr(m.encoder.layers, block).ln_1,
        x,
        target,
        tokens_to_grid(side, side, 1),
    )
    assert ours.amax() > 0
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_torchvision_vision_transformer_small():
    """The class behind vit_b_16, with fewer, narrower layers (fast); vit_b_16 itself is the slow test."""
    tv_vit = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    vit = tv_vit.VisionTransformer(
        image_size=48,
        patch_size=16,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=5,
    ).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.5)  # torchvision initialises the head to zeros
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    _check_torchvision_vit(vit, "encoder_layer_1", x, [2, 4], 3)


@pytest.mark.slow
def test_torchvision_vit_b_16():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.vit_b_16(image_size=64, num_classes=5).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.05)  # torchvision initialises the head to zeros
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    _check_torchvision_vit(vit, "encoder_layer_11", x, [2], 4)


# -- HuggingFace -------------------------------------------------------------------------------
def test_huggingface_vit_from_config():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(cfg).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    layer = (
        "vit.layers.1.layernorm_before"
        if hasattr(model.vit, "layers")
        else "vit.encoder.layer.1.layernorm_before"
    )
    ours = hs.GradCAM(model, layer)(x)  # ModelOutput: the logits are found by name
    pred = model(x).logits.argmax(1).tolist()
    assert ours.shape == (2, 32, 32)
    torch.testing.assert_close(
        ours, hs.GradCAM(model, layer)(x, target=lambda out: out.logits[:, pred].diagonal())
    )
    for method in ("gradcam++", "layercam", "eigencam"):
        assert hs.get_cam(method)(model, layer)(x).shape == (2, 32, 32)


def test_huggingface_convnext_from_config():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, image_size=32
    )
    model = transformers.ConvNextForImageClassification(cfg).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    stage = next(n for n, _ in model.named_modules() if n.endswith("stages.1"))
    ours = hs.GradCAM(model, stage)(x, target=[0, 3])
    twin = copy.deepcopy(model)

    class Logits(nn.Module):  # pytorch-grad-cam needs a tensor output
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).logits

    wrapped = Logits(twin)
    ref = reference(wrapped, lambda m: m.m.get_submodule(stage), x, [0, 3], None)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
