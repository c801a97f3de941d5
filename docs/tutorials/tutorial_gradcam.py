"""
Grad-CAM, on a CNN and on a ViT
===============================

A class activation map shows which part of the input a prediction depends on: Grad-CAM weights
a layer's channels by the average gradient of the class score and keeps the positive part.
:class:`hookscope.GradCAM` returns a ``(B, H, W)`` map in ``[0, 1]`` on the input's device; the
gradient is taken with respect to the layer's output only, so nothing before the layer is
recorded and no parameter gets a ``.grad``. :func:`hookscope.overlay` blends a map over a
picture.
"""

# %%
import torch
from PIL import Image

import hookscope as hs

model = hs.load_demo_model()
data = hs.make_demo_dataset(8, seed=4)
x = data.images


def picture(img: torch.Tensor, size: int = 128) -> Image.Image:
    return Image.fromarray((img.permute(1, 2, 0) * 255).byte().numpy()).resize((size, size))


# %%
# Grad-CAM on the demo CNN
# ------------------------
# ``stage3`` is the last convolutional stage (16×16). With ``target=None`` each sample's map
# explains its predicted class.
cam = hs.GradCAM(model, "stage3")(x)
pred = model(x).argmax(1)
print(tuple(cam.shape), float(cam.min()), float(cam.max()))
print("predicted:", [model.classes[p] for p in pred])


def strip(maps: torch.Tensor) -> Image.Image:
    tiles = [hs.overlay(picture(x[i]), maps[i], alpha=0.45) for i in range(len(x))]
    out = Image.new("RGB", (128 * len(tiles), 128))
    for i, t in enumerate(tiles):
        out.paste(t, (128 * i, 0))
    return out


overlays = strip(cam)

# %%
# The map of a class the model did not predict: where is the evidence for "circle"?
circle = model.classes.index("circle")
circle_maps = strip(hs.GradCAM(model, "stage3")(x, target=circle))

# %%
# The CAM family
# --------------
# GradCAM++, XGradCAM, HiResCAM, LayerCAM, EigenCAM and ScoreCAM share the contract; pick one
# by name with :func:`hookscope.get_cam`.
print(sorted(hs.cam_methods()))
for name in ("gradcam++", "layercam", "eigencam"):
    m = hs.get_cam(name)(model, "stage3")(x)
    agree = torch.nn.functional.cosine_similarity(m.flatten(1), cam.flatten(1)).mean()
    print(f"{name:10s} mean cosine similarity with Grad-CAM: {agree:.3f}")

# %%
# A Vision Transformer
# --------------------
# A ViT layer's output is a sequence of tokens, not a grid. hookscope drops the class token
# and reshapes the patch tokens to their grid when the shape says so unambiguously (here 8×8
# patches). A small torchvision ``VisionTransformer`` with random weights: the map shows the
# mechanics, not a meaningful explanation.
from torchvision.models.vision_transformer import VisionTransformer  # noqa: E402

torch.manual_seed(0)
vit = VisionTransformer(
    image_size=64,
    patch_size=8,
    num_layers=2,
    num_heads=2,
    hidden_dim=64,
    mlp_dim=128,
    num_classes=4,
).eval()
# torchvision initialises the classification head to zeros: every score is then constant, every
# gradient zero and every map blank (hookscope warns of it); give the head random weights
torch.nn.init.normal_(vit.heads.head.weight, std=0.02)
layer = "encoder.layers.encoder_layer_1.ln_1"
vit_cam = hs.GradCAM(vit, layer)(x, target=0)
print(tuple(vit_cam.shape))
vit_overlays = strip(vit_cam)

# %%
# A token layout hookscope cannot infer (extra register tokens, a non-square grid) raises a
# :class:`~hookscope.ReshapeError` that says which ``reshape=(h, w)`` to pass; passing it
# explicitly always works:
print(tuple(hs.GradCAM(vit, layer, reshape=(8, 8))(x[:1]).shape))
