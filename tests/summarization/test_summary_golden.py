"""Golden files for the summary table and the ``hookscope summary`` CLI.

Regenerate after an intended change with ``HOOKSCOPE_REGEN_GOLDEN=1 pytest tests/summarization/test_summary_golden.py``
and review the diff. Timings are left out (no time column; ``time_ms`` dropped from JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import hookscope as hs
from hookscope.cli import main
from hookscope.cli._modelspec import load_model

GOLDEN = Path(__file__).parent / "golden" / "summary"
NET = f"{GOLDEN / 'net.py'}"
NO_TIME = ["type", "input", "output", "params", "trainable", "flops", "bytes"]
REGEN = os.environ.get("HOOKSCOPE_REGEN_GOLDEN") == "1"


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"missing golden file {path}; run with HOOKSCOPE_REGEN_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), (
        f"{name} differs from the golden file (HOOKSCOPE_REGEN_GOLDEN=1 to update)"
    )


def drop_times(obj):
    if isinstance(obj, dict):
        return {k: drop_times(v) for k, v in obj.items() if k != "time_ms"}
    if isinstance(obj, list):
        return [drop_times(v) for v in obj]
    return obj


@pytest.mark.parametrize("ascii", [False, True], ids=["unicode", "ascii"])
def test_table_golden(ascii):
    net = load_model(f"{NET}:Net")
    s = hs.summary(net, input_size=(1, 3, 8, 8))
    check(
        f"net_{'ascii' if ascii else 'unicode'}.txt", s.to_text(ascii=ascii, columns=NO_TIME) + "\n"
    )


def test_tied_table_golden():
    lm = load_model(f"{NET}:TiedLM")
    s = hs.summary(lm, torch.tensor([[1, 2, 3, 4]]), columns=NO_TIME)
    check("tied_lm.txt", s.to_text(ascii=True) + "\n")


def test_cli_table_golden(capsys):
    args = ["summary", f"{NET}:Net", "--input", "1,3,8,8", "--columns", ",".join(NO_TIME)]
    assert main(args) == 0
    check("cli_net.txt", capsys.readouterr().out)
    assert main([*args, "--depth", "1"]) == 0
    check("cli_net_depth1.txt", capsys.readouterr().out)


def test_cli_json_golden(capsys):
    assert main(["summary", f"{NET}:Net", "--input", "1,3,8,8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["totals"]["time_ms"] > 0
    check("cli_net.json", json.dumps(drop_times(data), indent=2) + "\n")


@pytest.mark.parametrize(
    ("args", "golden"),
    [
        ([f"{NET}:Broken", "--input", "1,3,8,8"], "cli_error_model.txt"),
        ([f"{NET}:Nope", "--input", "1,3,8,8"], None),
        ([f"{NET}:Net", "--input", "1,3,0,8"], None),
        ([f"{NET}:Net", "--input", "1,3,8,8", "--columns", "flop"], None),
        (["torchvision.models:resnet18", "--input", "1,3,64"], None),
    ],
    ids=["failing-model", "bad-spec", "bad-shape", "bad-column", "wrong-rank"],
)
def test_cli_errors_one_line_exit_2(capsys, args, golden):
    assert main(["summary", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookscope: error: ") and err.count("\n") == 1, err
    if golden:
        check(golden, err)
