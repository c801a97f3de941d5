"""`hookscope summary`: hookscope's own refusals and bugs are shown as they are, never as "the
model failed on input ..." (which is kept for errors the model raised, located in a layer)."""

from __future__ import annotations

import pytest

import hookscope as hs
from hookscope.cli import main

MODEL_FILE = """
import torch
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc1(x)

def scripted():
    return torch.jit.script(Tiny())
"""


@pytest.fixture
def model_file(tmp_path):
    p = tmp_path / "tiny_s20.py"
    p.write_text(MODEL_FILE)
    return p


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("train", [False, True])
def test_a_torchscript_model_is_refused_in_one_line(train, model_file, capsys):
    """It crashed with a RuntimeError traceback (exit 1): the CLI's error locator put a hook on
    it before any check."""
    argv = ["summary", f"{model_file}:scripted", "--input", "2,3"] + (["--train"] if train else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model failed" not in err
    assert "is a TorchScript module, which cannot run Python hooks" in err


def test_a_refusal_inside_summary_is_its_own_message(model_file, monkeypatch, capsys):
    import hookscope.cli._summary as cli_summary

    def refuse(*args, **kwargs):
        raise hs.UnsupportedModelError("summary cannot do this, for this reason; do that")

    monkeypatch.setattr(cli_summary, "summary", refuse)
    assert main(["summary", f"{model_file}:Tiny", "--input", "2,3"]) == 2
    err = capsys.readouterr().err
    assert err == "hookscope: error: summary cannot do this, for this reason; do that\n"


def test_a_bug_in_summary_keeps_its_traceback(model_file, monkeypatch):
    import hookscope.cli._summary as cli_summary

    def bug(*args, **kwargs):
        raise KeyError("an internal table")

    monkeypatch.setattr(cli_summary, "summary", bug)
    with pytest.raises(KeyError, match="an internal table"):
        main(["summary", f"{model_file}:Tiny", "--input", "2,3"])


def test_the_model_failing_is_still_one_line_naming_the_layer(model_file, capsys):
    # the reference: the model itself rejects a (2, 5) input in fc1
    assert main(["summary", f"{model_file}:Tiny", "--input", "2,5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model failed in layer 'fc1' (input (2, 5))" in err
