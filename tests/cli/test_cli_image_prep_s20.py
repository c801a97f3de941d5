"""The CLI's image preprocessing (cam, maps, report: --resize 256 --crop 224 and ImageNet
statistics, "default: ImageNet") rounded the longer side and floored the crop offsets, where
torchvision's Resize truncates and CenterCrop rounds: 2.53 off
Compose([Resize(256), CenterCrop(224), ToTensor(), Normalize]) on a 301x457 image, silently.
It now equals torchvision bit for bit."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from hookscope.cli._cam import IMAGENET_MEAN, IMAGENET_STD, load_image

PIL = pytest.importorskip("PIL.Image")
T = pytest.importorskip("torchvision.transforms")


@pytest.mark.parametrize("w, h", [(301, 457), (640, 427), (256, 256), (500, 333), (225, 999)])
def test_cli_preprocessing_equals_torchvision(tmp_path, w, h):
    rng = np.random.default_rng(w * h)
    path = tmp_path / "x.png"
    PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    args = argparse.Namespace(
        image=str(path), resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, gray=False
    )
    x, _ = load_image(args)
    ref = T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )(PIL.open(path).convert("RGB"))
    assert torch.equal(x[0], ref)
