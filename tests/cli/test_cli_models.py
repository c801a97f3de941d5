"""The CLI builds Hugging Face models from a config (a JSON file, a folder, a config class) and
its errors on bad specs are one line."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from hookscope.cli import main


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _bert_config(tmp_path: Path) -> tuple[Path, object]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    config.to_json_file(tmp_path / "config.json")
    return tmp_path / "config.json", config


def test_cli_builds_a_hugging_face_model_from_a_config_json(tmp_path):
    import transformers

    path, config = _bert_config(tmp_path)
    expected = sum(p.numel() for p in transformers.AutoModel.from_config(config).parameters())
    for spec in (f"hf:{path}", f"hf:{tmp_path}"):  # the file, or the folder holding it
        rc, out, err = _run(["summary", spec, "--input", "1,8", "--dtype", "long", "--json"])
        assert rc == 0, err
        got = json.loads(out)
        assert got["model"] == "BertModel" and got["totals"]["params"] == expected
    rc, out, err = _run(
        ["summary", f"hf:{path}@AutoModelForMaskedLM", "--input", "1,8", "--dtype", "long"]
    )
    assert rc == 0 and "BertForMaskedLM summary" in out, err


def test_cli_builds_a_hugging_face_model_from_a_config_class():
    spec = "hf:GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)@AutoModelForCausalLM"
    rc, out, err = _run(["trace", spec, "--input", "1,6", "--dtype", "long", "--layers", "lm_head"])
    assert rc == 0, err
    assert re.search(r"^lm_head\s+0 Linear .* \[1, 6, 16\] -> \[1, 6, 100\]$", out, re.M), out


def test_cli_hf_spec_errors_are_one_line(tmp_path):
    cases = {
        "hf:NoSuchConfig(a=1)": "is not a transformers config class",
        f"hf:{tmp_path / 'missing.json'}": "no config file",
        f"hf:{tmp_path}": "no config file",
        "hf:BertConfig()@NotAnAutoClass": "is not a transformers Auto class",
    }
    for spec, message in cases.items():
        rc, _, err = _run(["summary", spec, "--input", "1,8", "--dtype", "long"])
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (spec, err)
