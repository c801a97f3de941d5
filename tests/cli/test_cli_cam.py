"""``hookscope cam`` and ``hookscope maps``: outputs equal the API's, and bad input is one line,
exit code 2, no output file."""

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
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(6, 8, 3, padding=1),
            nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
        )

    def TinyGray():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    """
)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "tiny.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    PIL_Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(
        tmp_path / "img.png"
    )
    (tmp_path / "bad.png").write_text("not an image")
    return tmp_path


def _argv(command: str, files, model: str, layer: str, out) -> list[str]:
    """``command`` on ``files/img.png`` through ``files/tiny.py:<model>``, written to ``out``."""
    return [
        command,
        f"{files}/tiny.py:{model}",
        "--image",
        str(files / "img.png"),
        "--layer",
        layer,
        "--out",
        str(out),
    ]


def test_cam_writes_the_api_overlay(files, capsys):
    out = files / "cam.png"
    argv = _argv("cam", files, "Tiny", "2", out)
    assert main([*argv, "--resize", "24", "--crop", "20", "--target", "3"]) == 0
    assert "gradcam on '2', class 3" in capsys.readouterr().out
    # the same through the API: resize the shorter side to 24, center-crop 20, ImageNet mean/std
    with PIL_Image.open(files / "img.png") as im:
        im = im.convert("RGB").resize((32, 24), PIL_Image.BILINEAR).crop((6, 2, 26, 22))
    shown = np.asarray(im, dtype=np.float32) / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = ((torch.from_numpy(shown).permute(2, 0, 1) - mean[:, None, None]) / std[:, None, None])[
        None
    ]
    from hookscope.cli._modelspec import load_model

    model = load_model(f"{files}/tiny.py:Tiny").eval()
    expected = hs.overlay(shown, hs.GradCAM(model, "2")(x, target=3)[0])
    with PIL_Image.open(out) as written:
        assert np.array_equal(np.asarray(written), expected)


def test_cam_methods_and_preprocessing_flags(files, capsys):
    for method in ("gradcam++", "eigencam", "scorecam"):
        out = files / f"{method}.png"
        argv = [*_argv("cam", files, "Tiny", "2", out), "--method", method]
        assert main([*argv, "--resize", "0", "--crop", "0", "--mean", "0.5", "--std", "0.5"]) == 0
        with PIL_Image.open(out) as im:
            assert im.size == (40, 30)
    capsys.readouterr()


def test_gray_input(files, capsys):
    out = files / "gray.png"
    argv = _argv("cam", files, "TinyGray", "0", out)
    assert main([*argv, "--gray", "--crop", "24"]) == 0
    with PIL_Image.open(out) as im:
        assert im.size == (24, 24) and im.mode == "RGB"
    capsys.readouterr()


def test_maps_writes_a_png(files, capsys):
    out = files / "maps.png"
    argv = _argv("maps", files, "Tiny", "0", out)
    assert main([*argv, "--crop", "32", "--max-channels", "4", "--order", "index"]) == 0
    assert "4 of 6 channels of '0'" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("command", "change", "message"),
    [
        ("cam", {"--image": "missing.png"}, "does not exist"),
        ("cam", {"--image": "bad.png"}, "cannot read image"),
        ("maps", {"--image": "bad.png"}, "cannot read image"),
        ("cam", {"--layer": "9"}, "no layer named '9'"),
        ("maps", {"--layer": "9"}, "no layer named '9'"),
        ("cam", {"--method": "gradcm"}, "unknown CAM method 'gradcm'; did you mean gradcam"),
        ("cam", {"--target": "17"}, "class 17 out of range"),
        ("cam", {"--colormap": "jett"}, "unknown colormap"),
        ("cam", {"--crop": "999"}, "larger than the image"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_file(files, capsys, command, change, message):
    opts = {"--image": "img.png", "--layer": "2", "--crop": "24"}
    opts.update(change)
    argv = [command, f"{files}/tiny.py:Tiny", "--out", str(files / "out.png")]
    for k, v in opts.items():
        argv += [k, str(files / v) if k == "--image" else v]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in files.iterdir()) == ["bad.png", "img.png", "tiny.py"]


def test_cam_with_compile_writes_the_same_png(files, capsys):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    argv = ["cam", f"{files}/tiny.py:Tiny", "--image", str(files / "img.png"), "--layer", "2"]
    assert main([*argv, "--out", str(files / "eager.png"), "--target", "3"]) == 0
    assert (
        main([*argv, "--out", str(files / "c.png"), "--target", "3", "--compile", "aot_eager"]) == 0
    )
    capsys.readouterr()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did run compiled
    with PIL_Image.open(files / "eager.png") as a, PIL_Image.open(files / "c.png") as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))
    torch._dynamo.reset()
