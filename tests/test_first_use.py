"""What a new user stumbled on (issue 27), each fixed and proved: capture(stop=True) says it skipped
the rest of the block, trace reads as a tree with a header and aligned columns, shapes have one
form in trace and summary, the summary says which columns include the children, the CLI builds a
Hugging Face model from a config, and the README's Lightning example stops."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
import torch.nn as nn

import hookscope as hs
from hookscope.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


# -- capture(stop=True) ---------------------------------------------------------------------------
def test_capture_stop_skips_the_rest_of_the_block_and_says_so():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    out, after = None, []
    with hs.capture(net, "0", stop=True) as cap:
        out = net(x)
        after.append("ran")
    assert cap.stopped and out is None and after == []  # what the docs now say
    assert torch.equal(cap["0"], net[0](x))
    with hs.capture(net, "0") as cap2:  # no stop: the block runs to its end
        out = net(x)
    assert not cap2.stopped and torch.equal(out, net(x))
    with hs.capture(net, "2", stop=True) as cap3:  # the last layer: nothing left to skip
        net(x)
    assert cap3.stopped
    # the form that returns normally, named in capture's docstring
    feats = hs.FeatureExtractor(net, ["0"])(x)
    assert torch.equal(feats["0"], net[0](x))
    assert "cap.stopped" in hs.capture.__doc__ and "FeatureExtractor" in hs.capture.__doc__


# -- trace ----------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a_rather_long_submodule_name_for_the_columns = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.a_rather_long_submodule_name_for_the_columns(x))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> Out:
        h = self.blocks(self.stem(x) * scale)
        return Out(self.head(h), (h, h[:, :2]))


def _trace_lines(model: nn.Module, *args, width=None, **kwargs) -> tuple[list[str], hs.Trace]:
    buf = io.StringIO()
    with hs.trace(model, file=buf) as tr:
        model(*args, **kwargs)
    return buf.getvalue().splitlines(), tr


def test_trace_prints_a_header_and_a_tree_in_call_order():
    torch.manual_seed(0)
    net = Net()
    lines, tr = _trace_lines(net, torch.randn(2, 3), scale=torch.ones(1))
    header, body = lines[0], lines[1:]
    assert header.split()[:4] == ["layer", "#", "type", "ms"] and "input -> output" in header
    names = [e.layer for e in tr.events]
    # every parent before its children, in the order the calls started
    assert names == [
        "",
        "stem",
        "blocks",
        "blocks.0",
        "blocks.0.a_rather_long_submodule_name_for_the_columns",
        "blocks.0.act",
        "blocks.1",
        "blocks.1.a_rather_long_submodule_name_for_the_columns",
        "blocks.1.act",
        "head",
    ]
    assert len(body) == len(names)
    # indentation is the depth
    for line, ev in zip(body, tr.events):
        assert len(line) - len(line.lstrip()) == 2 * ev.depth
    # columns line up whatever the name's length: the type column starts at one place
    starts = {line.index(ev.type, len(header.split("#")[0])) for line, ev in zip(body, tr.events)}
    assert len(starts) == 1 and starts == {header.index("type")}


def test_trace_shortens_names_longer_than_its_column_and_keeps_them_in_events():
    deep = nn.Sequential()
    inner = deep
    for _ in range(12):  # a name deeper than 60 characters
        child = nn.Sequential()
        inner.add_module("a_long_level", child)
        inner = child
    inner.add_module("leaf", nn.Linear(2, 2))
    lines, tr = _trace_lines(deep, torch.randn(1, 2))
    leaf = next(e for e in tr.events if e.layer.endswith("leaf"))
    assert len(leaf.layer) > 60
    line = next(ln for ln in lines if ln.lstrip().startswith("…") and "leaf" in ln)
    assert line.split()[0].endswith("a_long_level.leaf")
    assert line.index(" Linear") == lines[0].index("type") - 1


def test_trace_marks_a_call_that_raised_and_names_the_layer():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 2))
    buf = io.StringIO()
    try:
        with hs.trace(net, file=buf) as tr:
            net(torch.randn(2, 3))
    except RuntimeError as e:
        assert "hookscope: raised inside layer '1'" in "\n".join(getattr(e, "__notes__", []))
    else:
        raise AssertionError("the model should have raised")
    assert [(e.layer, e.raised) for e in tr.events] == [("", True), ("0", False), ("1", True)]
    assert buf.getvalue().splitlines()[-1].split()[-1] == "raised"


def test_shapes_have_one_form_in_trace_and_summary():
    torch.manual_seed(0)
    net = Net()
    x, scale = torch.randn(2, 3), torch.ones(1)
    _, tr = _trace_lines(net, x, scale=scale)
    s = hs.summary(net, x, scale=scale)
    rows = {r.name: r for r in s.rows}
    for ev in tr.events:
        assert ev.input_shapes == rows[ev.layer].input_shapes, ev.layer
        assert ev.output_shapes == rows[ev.layer].output_shapes, ev.layer
    # a tensor gives a list; several tensors {path: shape}; no '' key anywhere
    assert rows["stem"].output_shapes == [2, 4] and rows["stem"].input_shapes == [2, 3]
    assert rows[""].input_shapes == {"0": [2, 3], "scale": [1]}
    assert rows[""].output_shapes == {"logits": [2, 2], "hidden.0": [2, 4], "hidden.1": [2, 2]}
    # the same text in the trace line, the summary table and its title
    text = "logits:[2, 2], hidden.0:[2, 4], hidden.1:[2, 2]"
    lines, _ = _trace_lines(net, x, scale=scale)
    assert lines[1].endswith(f"0:[2, 3], scale:[1] -> {text}")
    assert text in s.to_text(width=200, columns=["output"])
    assert s.inputs == "0:[2, 3], scale:[1]"
    assert json.loads(s.to_json())["rows"][1]["output_shapes"] == [2, 4]


# -- the summary legend ---------------------------------------------------------------------------
def test_summary_says_which_columns_include_the_children():
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Linear(3, 2))
    s = hs.summary(net, torch.zeros(1, 4))
    rows = {r.name: r for r in s.rows}
    # what the legend claims, on the numbers: params inclusive, FLOPs exclusive
    assert rows["0"].params == rows["0.0"].params == 15 and rows["0"].flops == 0
    assert rows["0.0"].flops == 2 * 4 * 3 and sum(r.flops for r in s.rows) == s.totals.flops
    text = str(s)
    assert "Params, Time ms: inclusive (the module and its children)" in text
    assert "FLOPs: exclusive (what the row ran itself; rows add up to the total; -- = none)" in text
    only_shapes = s.to_text(columns=["type", "output"])
    assert "inclusive" not in only_shapes and "exclusive" not in only_shapes
    assert "Params: inclusive" in s.to_text(columns=["params"])


# -- the CLI and Hugging Face configs --------------------------------------------------------------
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


# -- the README -----------------------------------------------------------------------------------
def test_lightning_example_stops_and_the_readme_shows_the_file_spec():
    trainers = (README.parent / "docs" / "guide" / "trainers.md").read_text()
    lightning = trainers[trainers.index("L.Trainer(") :]
    assert "max_epochs=" in lightning[: lightning.index("trainer.fit")]
    text = README.read_text()
    assert "file.py:Name" in text and "hf:path/to/config.json" in text
