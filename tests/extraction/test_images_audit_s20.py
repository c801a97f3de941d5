"""Audit of ``hs.ImageFolder`` against PIL by hand and torchvision's documented transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hookscope as hs

Image = pytest.importorskip("PIL.Image")


def _save(path, array, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return path


def test_default_preprocessing_is_torchvisions_to_the_pixel(tmp_path):
    # (301, 457) made the long side 389 (round) where torchvision's Resize makes 388 (int), and
    # odd margins cropped one pixel off torchvision's CenterCrop (floor against round): 2.6 off
    T = pytest.importorskip("torchvision.transforms")
    ref = T.Compose(
        [
            T.Resize(256),
            T.CenterCrop(224),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    rng = np.random.default_rng(0)
    sizes = [(301, 457), (640, 427), (333, 500), (256, 300), (480, 641), (225, 224)]
    for i, (h, w) in enumerate(sizes):
        _save(tmp_path / f"{i}.png", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    ds = hs.ImageFolder(tmp_path)
    for i in range(len(ds)):
        with Image.open(ds.samples[i][0]) as im:
            expected = ref(im.convert("RGB"))
        assert torch.equal(ds[i][0], expected), sizes[i]
