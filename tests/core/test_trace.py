"""trace: a live tree of every call with aligned columns, names shortened to the column, the layer
that raised marked; shapes in the same form as the summary's."""

from __future__ import annotations

import dataclasses
import io
import json

import torch
import torch.nn as nn

import hookscope as hs


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


def test_trace_refuses_a_file_name_in_one_line():
    """file= takes a stream; a path used to fail in the first print with
    "'str' object has no attribute 'write'"."""
    import pytest

    net = nn.Linear(2, 2)
    with pytest.raises(
        TypeError, match=r"trace: file must be an open text stream.*got str: 'x\.txt'"
    ):
        hs.trace(net, file="x.txt")
    assert hs.hooks_on(net) == []
