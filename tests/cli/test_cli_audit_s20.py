"""CLI audit (s20): bad input is one line with exit code 2 and leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from hookscope.cli import main

MODELS = """
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Conv2d(4, 4, 3, padding=1)
        self.layer10 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.layer10(self.layer1(self.conv(x)))
        return self.fc(self.pool(x).flatten(1))

class Boom(Tiny):
    def forward(self, x):
        self.layer1(self.conv(x))
        raise RuntimeError("boom midway")

class Nan(Tiny):
    def forward(self, x):
        x = self.layer1(self.conv(x)) * float("nan")
        return self.fc(self.pool(self.layer10(x)).flatten(1))
"""


@pytest.fixture
def files(tmp_path):
    from PIL import Image

    (tmp_path / "models.py").write_text(MODELS)
    pixels = np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    return tmp_path


def _fails_in_one_line(argv, capsys, message):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hookscope: error: "), err
    assert message in err


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("Boom", [], "boom midway"),  # the model raises midway through the report's run
        ("Tiny", ["--layer", "layer5"], "closest valid names: 'layer1'"),
    ],
)
def test_a_failed_report_leaves_no_folder_behind(files, capsys, model, extra, message):
    before = _listing(files)
    out = files / "rep" / "sub"
    argv = ["report", f"{files / 'models.py'}:{model}", "--image", str(files / "img.png")]
    argv += ["--out", str(out), "--resize", "16", "--crop", "16", *extra]
    _fails_in_one_line(argv, capsys, message)
    assert _listing(files) == before  # neither rep/ nor rep/sub/ was left (both were, empty)


def test_a_failed_report_keeps_a_folder_that_was_there(files, capsys):
    (files / "rep").mkdir()
    argv = ["report", f"{files / 'models.py'}:Boom", "--image", str(files / "img.png")]
    _fails_in_one_line([*argv, "--out", str(files / "rep")], capsys, "boom midway")
    assert (files / "rep").is_dir()


@pytest.mark.parametrize("dtype", ["qint8", "quint8"])
def test_a_dtype_no_input_can_be_made_of_is_one_line(files, capsys, dtype):
    argv = ["trace", f"{files / 'models.py'}:Tiny", "--input", "1,3,8,8", "--dtype", dtype]
    _fails_in_one_line(argv, capsys, f"--dtype {dtype}: cannot make inputs of it")


def test_maps_of_a_nan_layer_is_refused_and_writes_nothing(files, capsys):
    before = _listing(files)
    argv = ["maps", f"{files / 'models.py'}:Nan", "--image", str(files / "img.png")]
    argv += ["--layer", "layer10", "--out", str(files / "m.png"), "--resize", "16", "--crop", "16"]
    _fails_in_one_line(argv, capsys, "NaN")
    assert _listing(files) == before
