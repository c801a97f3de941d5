"""The built-in demo model and its data: generator determinism, shipped weights, accuracy on fresh
test images, and Grad-CAM pointing at the shape (checked against each image's true bounding box)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.cli._modelspec import load_model
from hookscope.demo._data import _shape_mask
from hookscope.demo._model import (
    TEST_SEED,
    WEIGHTS_PATH,
    evaluate_demo_model,
    save_demo_weights,
    train_demo_model,
)


@pytest.fixture(scope="module")
def model() -> hs.DemoNet:
    return hs.load_demo_model()


@pytest.fixture(scope="module")
def test_set() -> hs.DemoDataset:
    # TEST_SEED is never drawn from during training (training uses seeds 999 and 1000 + epoch)
    return hs.make_demo_dataset(1000, seed=TEST_SEED)


# -- the generator --------------------------------------------------------------------------------
def test_same_seed_same_data_other_seed_other_data():
    a, b, c = (
        hs.make_demo_dataset(24, seed=5),
        hs.make_demo_dataset(24, seed=5),
        hs.make_demo_dataset(24, seed=6),
    )
    assert (
        torch.equal(a.images, b.images)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.boxes, b.boxes)
    )
    assert not torch.equal(a.images, c.images)
    assert a.images.dtype == torch.float32 and a.images.shape == (24, 3, 64, 64)
    assert float(a.images.min()) >= 0.0 and float(a.images.max()) <= 1.0
    # classes balanced, boxes inside the image and of the sizes the generator draws
    assert torch.bincount(a.labels, minlength=4).tolist() == [6, 6, 6, 6]
    x0, y0, x1, y1 = a.boxes.T
    assert bool(((x0 >= 0) & (x0 < x1) & (x1 < 64) & (y0 >= 0) & (y0 < y1) & (y1 < 64)).all())
    side = torch.maximum(x1 - x0, y1 - y0) + 1
    assert int(side.min()) >= 12 and int(side.max()) <= 37


def test_dataset_len_indexing_and_bad_arguments():
    ds = hs.make_demo_dataset(5, seed=0)
    assert len(ds) == 5
    img, label = ds[3]
    assert torch.equal(img, ds.images[3]) and int(label) == int(ds.labels[3])
    assert len(list(ds)) == 5
    assert len(hs.make_demo_dataset(0)) == 0
    with pytest.raises(ValueError, match="n must be"):
        hs.make_demo_dataset(-1)


def test_box_is_the_exact_extent_of_the_shape_pixels():
    # hand-computed: a circle of radius 0.8 * 10 = 8 centred on (32, 32) covers pixel centres
    # 24.5 .. 39.5, i.e. pixels 24 .. 39 in both directions
    m = _shape_mask(0, 32.0, 32.0, 10.0, 0.0)
    ys, xs = np.nonzero(m)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (24, 39, 24, 39)
    # an axis-aligned square of half-side 0.7 * 10 = 7 around (20, 40): centres 13.5 .. 26.5 and
    # 33.5 .. 46.5, i.e. pixels 13 .. 26 and 33 .. 46
    m = _shape_mask(1, 20.0, 40.0, 10.0, 0.0)
    ys, xs = np.nonzero(m)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (13, 26, 33, 46)
    assert m.sum() == 14 * 14


# -- the model and its weights ------------------------------------------------------------------------
def test_weights_ship_small_and_load_with_weights_only(model):
    assert WEIGHTS_PATH.is_file() and WEIGHTS_PATH.stat().st_size < 1_000_000
    blob = torch.load(WEIGHTS_PATH, map_location="cpu", weights_only=True)
    assert blob["classes"] == ["circle", "square", "triangle", "cross"]
    assert not model.training
    assert model.classes == hs.make_demo_dataset(1).classes
    assert model.default_input_shape == (1, 3, 64, 64)
    assert any(isinstance(m, nn.ReLU) and m.inplace for m in model.modules())
    assert [n for n, _ in model.named_children()] == ["stage1", "stage2", "stage3", "head"]
    spec_model = load_model("demo")
    assert all(
        torch.equal(a, b)
        for a, b in zip(spec_model.state_dict().values(), model.state_dict().values())
    )


def test_a_file_that_is_not_demo_weights_is_refused(tmp_path):
    bad = tmp_path / "w.pt"
    torch.save({"format": 99}, bad)
    with pytest.raises(ValueError, match="not a hookscope demo weights file"):
        hs.load_demo_model(bad)
    with pytest.raises(FileNotFoundError, match="python -m hookscope.demo._model train"):
        hs.load_demo_model(tmp_path / "missing.pt")


def test_accuracy_on_a_fresh_test_set_is_at_least_95_percent(model, test_set):
    acc = evaluate_demo_model(model, test_set)
    assert acc >= 0.95, f"demo model accuracy {acc:.4f} on {len(test_set)} fresh images"
    assert not model.training


def _reference_gradcam(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent Grad-CAM from plain autograd (no hookscope): stage3's activation is the input of
    the head, so run the two halves separately and differentiate the head."""
    with torch.no_grad():
        a = model.stage3(model.stage2(model.stage1(x)))
    a = a.clone().requires_grad_()
    out = model.head(a)
    pred = out.argmax(1)
    (g,) = torch.autograd.grad(out.gather(1, pred[:, None]).sum(), a)
    cam = F.relu((g.mean((2, 3), keepdim=True) * a).sum(1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    lo, hi = cam.flatten(1).min(1).values, cam.flatten(1).max(1).values
    return ((cam - lo[:, None, None]) / (hi - lo).clamp_min(1e-12)[:, None, None]).detach(), pred


def test_gradcam_maximum_falls_inside_the_shape_for_90_percent(model, test_set):
    n = 500
    x, labels, boxes = test_set.images[:n], test_set.labels[:n], test_set.boxes[:n]
    cams = hs.GradCAM(model, "stage3")(x)
    ref, pred = _reference_gradcam(model, x)
    torch.testing.assert_close(cams, ref, atol=1e-4, rtol=0)  # hs.GradCAM equals plain autograd
    peak = cams.flatten(1).argmax(1)
    px, py = peak % 64, peak // 64
    inside = (px >= boxes[:, 0]) & (px <= boxes[:, 2]) & (py >= boxes[:, 1]) & (py <= boxes[:, 3])
    correct = pred == labels
    rate = float(inside[correct].float().mean())
    assert int(correct.sum()) >= 0.95 * n
    assert rate >= 0.90, (
        f"Grad-CAM peak inside the box for {rate:.3f} of {int(correct.sum())} correct images"
    )


def test_training_is_deterministic_and_round_trips_through_the_weights_file(tmp_path):
    kw = dict(epochs=1, per_epoch=64, batch_size=32, seed=3, val_size=0, log=None)
    a, b = train_demo_model(**kw), train_demo_model(**kw)
    assert not a.training
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    path = save_demo_weights(a, tmp_path / "w.pt")
    c = hs.load_demo_model(path)
    x = hs.make_demo_dataset(4, seed=2).images
    with torch.no_grad():
        torch.testing.assert_close(c(x), a(x), rtol=0, atol=0)
