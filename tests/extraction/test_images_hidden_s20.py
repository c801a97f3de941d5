"""Images in hidden folders (a notebook's .ipynb_checkpoints, a .git) were samples like any other,
and a hidden first-level folder a class, without a word. Labels stay torchvision's ImageFolder's;
a warning now names the hidden folders and how many images lie there."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import hookscope as hs

PIL = pytest.importorskip("PIL.Image")
datasets = pytest.importorskip("torchvision.datasets")


def _png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(path)


def test_hidden_folders_are_said_and_labels_are_torchvision_s(tmp_path):
    for f in ("a/x.png", "b/y.png", ".ipynb_checkpoints/z.png", "b/.cache/w.png"):
        _png(tmp_path / f)
    with pytest.warns(hs.HookscopeWarning, match=r"2 image\(s\) lie in hidden folder\(s\)"):
        ours = hs.ImageFolder(tmp_path, image_size=None)
    ref = datasets.ImageFolder(str(tmp_path))
    assert ours.classes == ref.classes
    assert [(p, label) for p, label in ours.samples] == [
        (str(p), c) for p, c in sorted(ref.samples)
    ]


def test_no_hidden_folder_no_warning(tmp_path):
    for f in ("a/x.png", "b/y.png"):
        _png(tmp_path / f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.ImageFolder(tmp_path, image_size=None)
