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
        # --plot checked before the runs: no PATH.png beside a path without a suffix or a folder
        (["compare", "{rec}", "{rec}", "--plot", "{tmp}/plot"], "give a file name ending in"),
        (["compare", "{rec}", "{rec}", "--plot", "{tmp}"], "is a folder"),
        (["compare", "{rec}", "{rec}", "--plot", "{tmp}/no/x.png"], "does not exist"),
        (["compare", "{tmp}/no_such_record", "{rec}"], "no such record folder"),
        # a backend torch does not know: was a traceback and exit 1
        (["compare", "{spec}", "--input", "4,3", "--compile", "nosuch"], "--compile nosuch"),
        (["compare", "{rec}", "{spec}", "--compile", "nosuch"], "--compile nosuch"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(spec, tmp_path, capsys, args, needle):
    _record(spec, tmp_path / "rec")
    (tmp_path / "empty").mkdir()
    filled = [a.format(tmp=tmp_path / "empty", spec=spec, rec=tmp_path / "rec") for a in args]
    assert main(filled) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookscope: error:") and needle in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == []  # nothing written
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("empty.*"))


@pytest.mark.parametrize(
    "option",
    [
        ["--autocast", "bfloat16"],
        ["--loss", "square"],
        ["--loss", "none"],
        ["--loss", "sum"],  # the default, given: still an option that does nothing here
        ["--b-dtype", "bfloat16"],
        ["--compile"],
        ["--input", "4,3"],
        ["--dtype", "float32"],
        ["--device", "cpu"],
    ],
    ids=" ".join,
)
def test_an_option_for_a_live_model_with_two_records_is_refused_not_ignored(
    spec, tmp_path, capsys, option
):
    _record(spec, tmp_path / "a")
    _record(spec + "(eps=1.0)", tmp_path / "b")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hookscope: error: {option[0]}: two records are runs already made")
    assert "only to a live model B" in err and err.count("\n") == 1
    # two at once are named together
    both = ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--autocast", "bfloat16"]
    assert main([*both, "--loss", "square"]) == 2
    assert "error: --autocast, --loss: two records" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--input", "4,3"], ["--dtype", "float64"]], ids=" ".join)
def test_inputs_given_with_a_record_are_refused_the_record_s_are_used(
    spec, tmp_path, capsys, option
):
    _record(spec, tmp_path / "a")
    assert main(["compare", str(tmp_path / "a"), spec, *option]) == 2
    err = capsys.readouterr().err
    assert f"error: {option[0]}: B runs on the inputs the record" in err and err.count("\n") == 1


def test_loss_reduction_without_a_record_of_several_ranks_is_refused(spec, tmp_path, capsys):
    _record(spec, tmp_path / "a")
    _record(spec, tmp_path / "b")
    for args in (
        [spec, "--input", "4,3"],
        [spec, spec + "(eps=1.0)", "--input", "4,3"],
        [str(tmp_path / "a"), spec],
        [str(tmp_path / "a"), str(tmp_path / "b")],
    ):
        for value in ("mean", "sum"):
            assert main(["compare", *args, "--loss-reduction", value]) == 2
            err = capsys.readouterr().err
            assert "error: --loss-reduction applies only to a record made on several ranks" in err
            assert err.count("\n") == 1


def test_the_options_that_apply_still_change_the_comparison(spec, tmp_path, capsys):
    """--loss, --autocast, --b-dtype with a record and a model: each one changes the report
    (none of them is ignored there)."""
    _record(spec, tmp_path / "a")
    base = ["compare", str(tmp_path / "a"), spec, "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["dtypes"] == ["float32", "float32"] and plain["rows"][0]["grad_error"] == 0.0
    assert main([*base, "--autocast", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["dtypes"] == ["float32", "bfloat16"]
    assert main([*base, "--loss", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["grad_error"] is None
    assert main([*base, "--loss", "square"]) == 2  # the record was made with a sum: refused
    assert "another loss" in capsys.readouterr().err
