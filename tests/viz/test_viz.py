"""overlay and feature_maps: values, types, titles, PNG output, and the missing-extra message."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import hookscope as hs
from hookscope.viz import _pictures as _viz

PIL_Image = pytest.importorskip("PIL.Image")
mpl = pytest.importorskip("matplotlib")


def test_overlay_blends_with_the_colormap():
    img = np.full((4, 6, 3), 100, dtype=np.uint8)
    cam = torch.zeros(4, 6)
    cam[0, 0] = 1.0
    lut = mpl.colormaps["jet"](np.linspace(0, 1, 256))[:, :3]
    out = hs.overlay(img, cam, alpha=0.25)
    assert out.shape == (4, 6, 3) and out.dtype == np.uint8
    expect_hot = np.round((0.75 * 100 / 255 + 0.25 * lut[255]) * 255)
    expect_cold = np.round((0.75 * 100 / 255 + 0.25 * lut[0]) * 255)
    np.testing.assert_allclose(out[0, 0], expect_hot, atol=1)
    np.testing.assert_allclose(out[3, 5], expect_cold, atol=1)
    assert np.array_equal(hs.overlay(img, cam, alpha=0.0), img)


def test_overlay_keeps_the_image_kind_and_resizes_the_cam():
    cam = torch.rand(1, 2, 3)  # (1, h, w) accepted, resized to the image
    pil = PIL_Image.fromarray(np.zeros((8, 12, 3), dtype=np.uint8))
    out = hs.overlay(pil, cam)
    assert isinstance(out, PIL_Image.Image) and out.size == (12, 8) and out.mode == "RGB"
    t = hs.overlay(torch.zeros(3, 8, 12), cam)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 8, 12) and t.min() >= 0 and t.max() <= 1
    gray = hs.overlay(np.zeros((8, 12), dtype=np.float32), cam.numpy())
    assert gray.shape == (8, 12, 3)
    # tensor and array paths agree
    np.testing.assert_allclose(np.asarray(out), (t.permute(1, 2, 0).numpy() * 255).round(), atol=1)


def test_overlay_errors():
    with pytest.raises(ValueError, match="alpha"):
        hs.overlay(np.zeros((2, 2, 3)), np.zeros((2, 2)), alpha=2)
    with pytest.raises(hs.HookscopeError, match="pick a sample"):
        hs.overlay(np.zeros((2, 2, 3)), np.zeros((3, 2, 2)))
    with pytest.raises(ValueError, match="unknown colormap"):
        hs.overlay(np.zeros((2, 2, 3)), np.zeros((2, 2)), colormap="jett")


def test_feature_maps_order_titles_and_png():
    act = torch.zeros(5, 4, 4)
    act[3] = 3.0
    act[1] = torch.arange(16.0).reshape(4, 4)
    act[4] = -1.0
    fig = hs.feature_maps(act, max_channels=3)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["1", "3", "4"]  # energy: mean square 80.5, 9, 1
    fig = hs.feature_maps(act[None], max_channels=2, order="index")
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["0", "1"]
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("normalize", ["channel", "global"])
def test_feature_maps_normalisation(normalize):
    act = torch.stack(
        [torch.zeros(2, 2), torch.full((2, 2), 2.0), torch.tensor([[0.0, 4.0], [0.0, 4.0]])]
    )
    fig = hs.feature_maps(act, order="index", normalize=normalize)
    shown = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    if normalize == "channel":
        np.testing.assert_allclose(shown[2], [[0, 1], [0, 1]])
        np.testing.assert_allclose(shown[1], [[0, 0], [0, 0]])  # a flat map stays flat
    else:
        np.testing.assert_allclose(shown[1], [[0.5, 0.5], [0.5, 0.5]])
        np.testing.assert_allclose(shown[2], [[0, 1], [0, 1]])


def test_feature_maps_errors():
    with pytest.raises(hs.HookscopeError, match="pick a sample"):
        hs.feature_maps(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="order"):
        hs.feature_maps(torch.zeros(3, 4, 4), order="size")  # type: ignore[arg-type]


def test_missing_extra_names_the_install_command():
    with pytest.raises(
        ImportError, match=r"needs no_such_plotting_library_xyz.*pip install 'hookscope\[viz\]'"
    ):
        _viz._need("no_such_plotting_library_xyz")
