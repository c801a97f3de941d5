"""The CLI backbone and `hookscope trace`: output, and one-line errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hookscope.cli import main

MODEL_FILE = """
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc1 = nn.Linear(3, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
"""


@pytest.fixture
def model_file(tmp_path):
    p = tmp_path / "tiny.py"
    p.write_text(MODEL_FILE)
    return p


def test_trace_prints_every_call(model_file, capsys):
    assert main(["trace", f"{model_file}:Tiny(width=5)", "--input", "2,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # a header, then the calls in the order they started: the model above its layers
    assert [line.split()[0] for line in lines] == ["layer", "<root>", "fc1", "act", "fc2"]
    assert lines[0].split()[1:4] == ["#", "type", "ms"]
    assert "[2, 3] -> [2, 5]" in lines[2] and lines[2].split()[4:6] == ["float32", "cpu"]
    assert "[2, 5] -> [2, 2]" in lines[4] and "[2, 3] -> [2, 2]" in lines[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "nomodule_xyz:Net", "--input", "1,3"], "cannot import module 'nomodule_xyz'"),
        (["trace", "torchvision.models:resnt18", "--input", "1,3,32,32"], "did you mean resnet18"),
        (["trace", "torchvision.models", "--input", "1,3"], "expected 'package.module:callable'"),
        (["trace", "{file}:Tiny", "--input", "1,x"], "bad shape '1,x'"),
        (
            ["trace", "{file}:Tiny", "--input", "1,4"],
            "the model failed in layer 'fc1' (input (1, 4))",
        ),
        (
            ["trace", "{file}:Tiny", "--input", "1,3", "--layers", "fc3"],
            "closest valid names: 'fc2', 'fc1'",
        ),
        (
            ["trace", "{file}:Tiny", "--input", "1,3", "--dtype", "float99"],
            "unknown --dtype 'float99'",
        ),
        (["trace", "{file}:Tiny"], "--input is required"),
        (["trace", "missing.py:Tiny", "--input", "1,3"], "model file 'missing.py' does not exist"),
        (["trace", "{file}:Nope", "--input", "1,3"], "has no attribute 'Nope'"),
        (
            ["summary", "{file}:Tiny", "--input", "2,3", "--width", "0"],
            "argument --width: expected an int >= 1 (characters), got '0'",
        ),
        (
            ["summary", "{file}:Tiny", "--input", "2,3", "--width", "ten"],
            "argument --width: expected an int >= 1 (characters), got 'ten'",
        ),
        (
            ["summary", "{file}:Tiny", "--input", "2,3", "--width", "15"],
            "width=15 is narrower than the narrowest table of these columns",
        ),
        (["summary", "{file}:Tiny", "--input", "2,3", "--depth", "-1"], "--depth must be >= 0"),
        (
            ["summary", "{file}:Tiny", "--input", "2,3", "--train", "--budget", "0"],
            "no set of modules to checkpoint brings the 56 saved bytes under the budget of 0",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, message, model_file, capsys):
    argv = [a.replace("{file}", str(model_file)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own checks (option types) exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hookscope: error: "), err
    assert message in err
    assert "Traceback" not in err


def test_console_script_and_python_m(model_file):
    r = subprocess.run(
        [sys.executable, "-m", "hookscope", "trace", f"{model_file}:Tiny", "--input", "1,7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "layer 'fc1'" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "hookscope", "trace"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "hookscope", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("hookscope ")


@pytest.mark.parametrize("train", [False, True])
def test_summary_error_not_located_in_a_layer_is_one_line(train, model_file, monkeypatch, capsys):
    # the catch-all line: an error that carries no located layer gives the input shapes
    import hookscope.cli._summary as cli_summary
    import hookscope.memory._profile as profile

    def fail(*args, **kwargs):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(cli_summary, "summary", fail)
    monkeypatch.setattr(profile, "memory_profile", fail)
    argv = ["summary", f"{model_file}:Tiny", "--input", "2,3"] + (["--train"] if train else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    if not train:
        # summary hooks the model itself too: an error naming no layer is not the model's, so it
        # is not said to be (a ValueError is one line as it is; another kind keeps its traceback)
        assert err == "hookscope: error: first line\n"
        return
    when = "in a training step on input"  # (a backward's errors name no layer)
    assert err == f"hookscope: error: the model failed {when} (2, 3): ValueError: first line\n"
