"""The command line as a new user meets it: an unknown option points at the subcommand's help,
and a model's error names the option that fixes it (``--dtype long``, ``--resize``/``--crop``,
``--input``); predictions of a model with random weights carry a note saying so."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import hookscope as hs
from hookscope.cli import main
from hookscope.cli._modelspec import random_weights

GPT2 = "hf:GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)"
VIT = (
    "hf:ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, "
    "num_attention_heads=2, intermediate_size=32)@AutoModelForImageClassification"
)
TV_VIT = (
    "torchvision.models.vision_transformer:VisionTransformer(image_size=32, patch_size=16, "
    "num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3)"
)
MODELS = """
import torch.nn as nn

class Tokens(nn.Module):  # an embedding first: takes token ids
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.emb(x))

class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)  # takes 4-D input only
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.pool(self.bn(self.conv(x))).flatten(1))
"""

# the one-block ViT's last block: its patch tokens do not reach the class token the head reads,
# so their gradient (and the map) is zero, which a warning says (CPU)
ZERO_GRAD = r"layer 'vit.layers.0' is zero everywhere"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse errors exit
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def files(tmp_path: Path) -> Path:
    import numpy as np
    from PIL import Image

    (tmp_path / "models.py").write_text(MODELS)
    pixels = (np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8")
    Image.fromarray(pixels).save(tmp_path / "img.png")
    return tmp_path


def _one_error_line(rc: int, err: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_an_unknown_option_points_at_the_help_of_its_subcommand(files):
    line = _one_error_line(*_run(["trace", f"{files}/models.py:Conv", "--inptu", "1,3,8,8"])[::2])
    assert "unrecognized arguments: --inptu" in line
    assert line.endswith("(see 'hookscope trace --help')"), line
    line = _one_error_line(*_run(["--inptu"])[::2])
    assert line.endswith("(see 'hookscope --help')"), line


def test_float_inputs_to_an_embedding_name_dtype_long(files):
    rc, _, err = _run(["summary", f"{files}/models.py:Tokens", "--input", "1,5"])
    line = _one_error_line(rc, err)
    assert "layer 'emb'" in line and line.endswith("token ids need --dtype long"), line
    rc, out, err = _run(
        ["summary", f"{files}/models.py:Tokens", "--input", "1,5", "--dtype", "long"]
    )
    assert rc == 0 and "Tokens summary" in out, err


def test_a_hugging_face_language_model_asks_for_dtype_long_before_running():
    rc, _, err = _run(["trace", GPT2, "--input", "1,6"])
    line = _one_error_line(rc, err)
    assert "takes token ids (input_ids), not float32 values: add --dtype long" in line, line


def test_token_ids_are_drawn_inside_a_vocabulary_smaller_than_100(capsys):
    # ids drawn from [0, 100) would index past a 50-token embedding
    assert main(["trace", GPT2, "--input", "1,6", "--dtype", "long", "--layers", "wte"]) == 0
    assert "[1, 6] -> [1, 6, 16]" in capsys.readouterr().out


def test_a_sequence_longer_than_the_learned_positions_is_refused_before_running():
    rc, _, err = _run(["trace", GPT2, "--input", "1,20", "--dtype", "long"])
    line = _one_error_line(rc, err)
    assert "--input 1,20: the model takes at most 16 positions" in line, line


def test_an_image_of_another_size_names_input_or_resize_and_crop(files):
    rc, _, err = _run(["summary", TV_VIT, "--input", "2,3,16,16"])
    line = _one_error_line(rc, err)
    assert line.endswith("the model was built for 32x32 images: give --input 2,3,32,32"), line
    argv = ["cam", VIT, "--image", str(files / "img.png"), "--layer", "vit.layers.0"]
    rc, _, err = _run([*argv, "--out", str(files / "cam.png")])  # default crop: 224
    line = _one_error_line(rc, err)
    assert line.endswith("the model was built for 32x32 images: add --resize 32 --crop 32"), line
    with pytest.warns(hs.HookscopeWarning, match=ZERO_GRAD):
        rc, out, err = _run(
            [*argv, "--out", str(files / "cam.png"), "--resize", "32", "--crop", "32"]
        )
    assert rc == 0 and out.startswith("wrote"), err


def test_predictions_of_a_model_with_random_weights_carry_a_note(files):
    argv = ["cam", VIT, "--image", str(files / "img.png"), "--layer", "vit.layers.0"]
    with pytest.warns(hs.HookscopeWarning, match=ZERO_GRAD):
        rc, out, err = _run(
            [*argv, "--out", str(files / "a.png"), "--resize", "32", "--crop", "32"]
        )
    assert rc == 0, err
    assert "note: the model was built from a config: its weights are random" in out, out
    argv = ["cam", f"{files}/models.py:Conv", "--image", str(files / "img.png"), "--layer", "conv"]
    rc, out, err = _run([*argv, "--out", str(files / "b.png"), "--resize", "16", "--crop", "16"])
    assert rc == 0 and "note:" not in out, out  # a user's own model: weights as given


def test_random_weights_is_told_from_the_spec_without_building_the_model():
    why = random_weights("torchvision.models:resnet50(num_classes=10)")
    assert why is not None and "resnet50(weights='DEFAULT')" in why
    assert "random" in (random_weights("torchvision.models:vit_b_16(weights=None)") or "")
    assert random_weights("torchvision.models:resnet50(weights='IMAGENET1K_V2')") is None
    assert "from a config" in (random_weights("hf:BertConfig()") or "")
    assert random_weights("torchvision.models:ResNet") is None  # a class: nothing to tell
    assert random_weights("demo") is None  # trained weights ship with the package


def test_a_missing_batch_size_and_integer_inputs_to_float_layers_name_the_fix(files):
    rc, _, err = _run(["summary", f"{files}/models.py:Conv", "--input", "3,8,8"])
    line = _one_error_line(rc, err)
    assert "layer 'bn'" in line, line
    assert line.endswith("a batch size is missing from --input: give --input 1,3,8,8"), line
    rc, _, err = _run(
        ["summary", f"{files}/models.py:Conv", "--input", "1,3,8,8", "--dtype", "long"]
    )
    line = _one_error_line(rc, err)
    assert line.endswith(
        "--dtype long gives integer inputs, this layer takes floats: use --dtype float32"
    ), line
    rc, out, err = _run(["summary", f"{files}/models.py:Conv", "--input", "1,3,8,8"])
    assert rc == 0 and "Conv summary" in out, err


def test_token_ids_of_another_rank_are_refused_before_running():
    rc, out, err = _run(["trace", GPT2, "--input", "1,8,4", "--dtype", "long"])
    line = _one_error_line(rc, err)
    assert "--input 1,8,4: token ids are (batch, sequence)" in line, line
    assert out == ""  # refused before the model ran: no partial trace
