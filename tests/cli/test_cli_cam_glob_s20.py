"""``hookscope cam --layer GLOB``: the success line names the layers whose maps were averaged,
not the glob (which said nothing of what it matched)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import hookscope as hs
from hookscope.cli import main

PIL_Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")

MODEL = textwrap.dedent(
    """
    import torch, torch.nn as nn

    def Tiny():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
        )
    """
)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "tiny.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    PIL_Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(
        tmp_path / "img.png"
    )
    return tmp_path


def _cam(files, layer: str, out) -> list[str]:
    return [
        "cam",
        f"{files}/tiny.py:Tiny",
        "--image",
        str(files / "img.png"),
        "--layer",
        layer,
        "--out",
        str(out),
        "--resize",
        "0",
        "--crop",
        "0",
        "--target",
        "3",
    ]


def _x(files) -> tuple[torch.Tensor, np.ndarray]:
    """The CLI's input with --resize 0 --crop 0: the image, normalised with ImageNet's statistics."""
    shown = torch.from_numpy(np.asarray(PIL_Image.open(files / "img.png"), np.float32) / 255.0)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return ((shown - mean) / std).permute(2, 0, 1)[None], shown.numpy()


def test_glob_success_line_names_the_layers_averaged(files, capsys):
    out = files / "cam.png"
    assert main(_cam(files, "[02]", out)) == 0  # the two convolutions
    line = capsys.readouterr().out.splitlines()[0]
    assert "on the average of 2 layers matching '[02]': '0', '2', class 3" in line, line
    # the picture is the API's average over those two layers
    x, shown = _x(files)
    ns: dict = {}
    exec(MODEL, ns)
    want = hs.overlay(shown, hs.GradCAM(ns["Tiny"]().eval(), ["0", "2"])(x, target=3)[0])
    with PIL_Image.open(out) as written:
        assert np.array_equal(np.asarray(written), want)


def test_one_layer_keeps_its_name_and_a_glob_of_one_names_it(files, capsys):
    assert main(_cam(files, "2", files / "a.png")) == 0
    assert "gradcam on '2', class 3" in capsys.readouterr().out
    assert main(_cam(files, "[2]", files / "b.png")) == 0
    line = capsys.readouterr().out
    assert "gradcam on '2', class 3" in line and "'[2]'" not in line, line


def test_glob_matching_many_layers_names_the_count_and_the_first(files, capsys):
    assert main(_cam(files, "[0-3]", files / "all.png")) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "average of 4 layers matching '[0-3]': '0', '1', '2' ..., class 3" in line, line
