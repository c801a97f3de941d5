"""Audit (round 18) of overlay: values it silently clipped to white or to the hottest colour."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hookscope as hs

pytest.importorskip("matplotlib")


def test_a_uint8_tensor_image_is_scaled_like_a_uint8_array():
    """``torchvision.io.read_image`` gives a uint8 (3, H, W) tensor: it was taken as floats in
    [0, 1] and clamped, so every non-black pixel blended as white."""
    arr = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    cam = torch.rand(6, 5)
    ref = hs.overlay(arr, cam)  # the array path (uint8 / 255)
    out = hs.overlay(torch.from_numpy(arr).permute(2, 0, 1), cam)
    assert out.dtype == torch.float32
    np.testing.assert_allclose((out.permute(1, 2, 0).numpy() * 255).round(), ref, atol=1)


@pytest.mark.parametrize(
    "image",
    [
        np.full((4, 4, 3), 200.0, dtype=np.float32),  # a float array of 0-255 values
        torch.full((3, 4, 4), 200.0),
        torch.randn(3, 4, 4) * 2,  # a normalised (mean/std) image
    ],
)
def test_a_float_image_outside_0_1_is_refused(image):
    """A float image in 0-255 (``np.asarray(img, dtype=np.float32)``) or normalised by
    mean/std was clamped to [0, 1]: a white (or black) picture, silently."""
    with pytest.raises(hs.HookscopeError, match=r"image.*\[0, 1\].*255"):
        hs.overlay(image, torch.rand(4, 4))


def test_an_integer_image_other_than_uint8_is_refused():
    with pytest.raises(hs.HookscopeError, match="uint8"):
        hs.overlay(np.full((4, 4, 3), 1000, dtype=np.uint16), torch.rand(4, 4))


@pytest.mark.parametrize("cam", [torch.rand(4, 4) * 30, torch.rand(4, 4) - 0.5])
def test_a_cam_outside_0_1_is_refused(cam):
    """A raw, unnormalised map (a channel's activation, a CAM before its normalisation) was
    clamped: everything above 1 showed the hottest colour."""
    with pytest.raises(hs.HookscopeError, match=r"cam.*\[0, 1\].*cam.min\(\)"):
        hs.overlay(np.zeros((4, 4, 3), dtype=np.uint8), cam)


def test_a_cam_with_nan_is_refused():
    cam = torch.rand(4, 4)
    cam[1, 2] = float("nan")
    with pytest.raises(hs.HookscopeError, match="NaN"):
        hs.overlay(np.zeros((4, 4, 3), dtype=np.uint8), cam)
