"""Progress bars come from tqdm: a bar on a terminal, a widget in a Jupyter kernel, nothing when
stderr is not a terminal, nothing with ``progress=False``."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import hookscope as hs
from hookscope.core._progress import progress_bar

SRC = str(Path(hs.__file__).resolve().parents[1])


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _net_and_data():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return net, TensorDataset(torch.randn(12, 3, 8, 8))


def test_extract_draws_a_bar_on_a_terminal(tmp_path, monkeypatch):
    net, data = _net_and_data()
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    hs.extract(net, data, ["1"], tmp_path / "a", batch_size=4)
    text = err.getvalue()
    assert "extract" in text and "12/12" in text and "100%" in text and "samples/s" in text
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    hs.extract(net, data, ["1"], tmp_path / "b", batch_size=4, progress=False)
    assert quiet.getvalue() == ""


def test_nothing_is_printed_when_stderr_is_not_a_terminal(tmp_path, capsys):
    net, data = _net_and_data()
    hs.extract(net, data, ["1"], tmp_path, batch_size=4)
    hs.ScoreCAM(net, "0", batch_size=2)(torch.randn(1, 3, 8, 8), target=lambda o: o.sum(1))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_resumed_run_starts_the_bar_at_what_is_done(monkeypatch):
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    with progress_bar(10, initial=4, desc="extract", unit="samples") as bar:
        assert bar.n == 4
        bar.update(6)
    assert "4/10" in err.getvalue() and "10/10" in err.getvalue()


def test_scorecam_counts_its_masked_batches(monkeypatch):
    net, _ = _net_and_data()
    x = torch.randn(2, 3, 8, 8)
    score = lambda o: o.sum(1)  # noqa: E731
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    with_bar = hs.ScoreCAM(net, "0", batch_size=3)(x, target=score)
    text = err.getvalue()
    assert "ScoreCAM" in text and "0/4 " in text  # 2 samples x ceil(4 channels / 3)
    assert text.endswith("\r")  # leave=False: the bar is cleared when done
    off = Tty()
    monkeypatch.setattr(sys, "stderr", off)
    without = hs.ScoreCAM(net, "0", batch_size=3, progress=False)(x, target=score)
    assert off.getvalue() == "" and torch.equal(with_bar, without)


@pytest.mark.slow
def test_extract_shows_a_widget_in_a_jupyter_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("ipywidgets")
    code = f"""
import sys
sys.path.insert(0, {SRC!r})
import torch, torch.nn as nn, hookscope as hs
from torch.utils.data import TensorDataset
net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
feats = hs.extract(net, TensorDataset(torch.randn(12, 3, 8, 8)), ["1"], {str(tmp_path / "f")!r}, batch_size=4)
print(feats["1"].shape)
"""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(code))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    widgets = [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, outputs
    assert any("(12, 4, 6, 6)" in o.get("text", "") for o in outputs), outputs
    # tqdm's widget, not the text bar printed to the notebook's stderr
    assert not any(o.get("name") == "stderr" for o in outputs), outputs
