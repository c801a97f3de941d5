"""`hookscope compare`: two records, a record and a model spec, a model and its bf16 copy; one-line
errors with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

import hookscope as hs
from hookscope.cli import main
from hookscope.cli._modelspec import load_model

MODEL_FILE = """
import torch, torch.nn as nn

class Tiny(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 8)
        self.norm = nn.LayerNorm(8, eps=eps)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))
"""


@pytest.fixture
def spec(tmp_path):
    p = tmp_path / "tiny.py"
    p.write_text(MODEL_FILE)
    return f"{p}:Tiny"


def _record(spec_text, folder):
    model = load_model(spec_text).eval()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    with hs.record(model, folder):
        model(x).sum().backward()
    return model, x


def test_two_records(spec, tmp_path, capsys):
    _record(spec, tmp_path / "a")
    _record(spec + "(eps=1.0)", tmp_path / "b")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergent"] == "norm" and out["culprit"] is None
    assert "culprit needs" in out["notes"][0]


def test_a_record_against_a_model_spec_runs_on_the_recorded_inputs(spec, tmp_path, capsys):
    _record(spec, tmp_path / "a")
    assert main(["compare", str(tmp_path / "a"), spec + "(eps=1.0)", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit"] == "norm"
    assert main(["compare", str(tmp_path / "a"), spec, "--b-dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "culprit None" in text and "float32 (a) vs bfloat16 (b)" in text


def test_a_model_against_its_bf16_copy_and_a_changed_model(spec, tmp_path, capsys):
    assert main(["compare", spec, "--input", "4,3", "--b-dtype", "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit"] is None
    png = tmp_path / "plot.png"
    args = ["compare", spec, spec + "(eps=1.0)", "--input", "4,3", "--plot", str(png)]
    assert main(args) == 0
    assert "culprit 'norm'" in capsys.readouterr().out and png.stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["compare", "{tmp}", "{tmp}"], "not a record"),
        (["compare", "{spec}", "--input", "4,3", "--b-dtype", "int8"], "unknown --b-dtype"),
        (["compare", "{rec}"], "a record needs B"),
        (["compare", "{spec}", "{rec}", "--input", "4,3"], "giving the record first"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(spec, tmp_path, capsys, args, needle):
    _record(spec, tmp_path / "rec")
    (tmp_path / "empty").mkdir()
    filled = [a.format(tmp=tmp_path / "empty", spec=spec, rec=tmp_path / "rec") for a in args]
    assert main(filled) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookscope: error:") and needle in err and err.count("\n") == 1
