"""Audit of hs.compare / hs.record at the edges: runs a record cannot hold as one forward and its
backward (autocast, no call, another thread, random draws, two backwards, gradients changed inside
the block), and the report's plain data. Each test proves its value against a plain run."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.compare._store import SPOOL


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def _net(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh())
    return net, torch.randn(4, 16)


def _nothing_written(folder: Path) -> None:
    assert not (folder / "index.json").exists()
    assert not (folder / SPOOL).exists()


# -- a record made under torch.autocast ------------------------------------------------------------
def test_a_record_made_under_autocast_carries_its_dtype_and_a_fault_free_copy_is_no_culprit(
    tmp_path,
):
    """Recorded under bf16 autocast, compared with a live fp32 copy: the tolerance is bf16's
    (the record said fp32, and every module of a fault-free copy was named)."""
    net, x = _net()
    with hs.record(net, tmp_path):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
        _loss(out).backward()
    net.zero_grad(set_to_none=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = net(x)  # the plain run: what the record holds
    assert json.loads((tmp_path / "index.json").read_text())["autocast"] == "bfloat16"
    report = hs.compare(str(tmp_path), copy.deepcopy(net), x, loss_fn=_loss)
    assert report.dtypes == ("bfloat16", "float32")
    assert report.culprit is None, report
    # the root row's error is the plain autocast run against the fp32 one
    with torch.no_grad():
        want = float((net(x) - plain.float()).norm() / plain.float().norm())
    assert report.row("").error == pytest.approx(want, rel=1e-3)


# -- runs that are no record: refused at the end of the block, nothing left behind ---------------
def test_a_block_where_the_model_never_ran_is_refused_not_an_empty_record(tmp_path):
    """An empty record compared with a live model gave zero rows and no culprit (a warning that
    blamed layers=)."""
    net, _ = _net()
    refused = pytest.raises(hs.CompareError, match=r"no call of the model \(Sequential\)")
    with refused, hs.record(net, tmp_path):
        pass
    _nothing_written(tmp_path)


def test_a_model_run_in_another_thread_is_refused_naming_the_thread(tmp_path):
    """The hooks act on the thread that entered hs.record only: a forward in a worker thread was
    recorded as nothing."""
    net, x = _net()
    calls = []
    plain = net.register_forward_hook(lambda m, i, o: calls.append(1))  # it sees the call

    def work() -> None:
        _loss(net(x)).backward()

    refused = pytest.raises(hs.CompareError, match=r"another thread \('worker'\)")
    with refused, hs.record(net, tmp_path):
        t = threading.Thread(target=work, name="worker")
        t.start()
        t.join()
    plain.remove()
    assert calls == [1]
    _nothing_written(tmp_path)


class _FunctionalDropout(nn.Module):
    """Dropout as a function, in eval mode too: no nn.Dropout for a list of module types."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.5, training=True)


def test_a_forward_that_draws_random_numbers_is_refused_while_recording(tmp_path):
    """Two records of a model with functional dropout compared as if they were values (the root
    differed by 0.9 and was reported as a divergence)."""
    net = _FunctionalDropout().eval()
    x = torch.randn(4, 16)
    a, b = net(x), net(x)
    assert not torch.equal(a, b)  # the reference: two plain runs differ
    refused = pytest.raises(hs.CompareError, match="drew random numbers")
    with refused, hs.record(net, tmp_path):
        _loss(net(x)).backward()
    _nothing_written(tmp_path)
    # draws outside the model's forward (making the inputs inside the block) are not the model's
    net.zero_grad(set_to_none=True)
    lin = nn.Linear(16, 16)
    with hs.record(lin, tmp_path):
        _loss(lin(torch.randn(4, 16))).backward()
    assert (tmp_path / "index.json").exists()


def test_two_backwards_in_one_block_are_refused_not_doubled_parameter_gradients(tmp_path):
    """backward(retain_graph=True) then another: .grad held twice the gradient while the
    activation gradients held one, and a fault-free copy was named (parameter gradients 0.5 off)."""
    net, x = _net()
    refused = pytest.raises(
        hs.CompareError, match="written twice: the block ran more than one backward"
    )
    with refused, hs.record(net, tmp_path):
        loss = _loss(net(x))
        loss.backward(retain_graph=True)
        loss.backward()
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    "after",
    [
        lambda net: net.zero_grad(set_to_none=True),
        lambda net: net.zero_grad(set_to_none=False),
        lambda net: torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3),
    ],
    ids=["zero_grad", "zero_grad-in-place", "clip_grad_norm"],
)
def test_gradients_changed_inside_the_block_after_backward_are_refused(tmp_path, after):
    """A training step inside the block (backward, clip, step, zero_grad) left params.pt with other
    gradients than backward made: a fault-free copy was named, or a layer's gradient went unchecked."""
    net, x = _net()
    refused = pytest.raises(hs.CompareError, match=r"gradients of '0.weight', '0.bias', '2.weight'")
    with refused, hs.record(net, tmp_path):
        _loss(net(x)).backward()
        after(net)
    _nothing_written(tmp_path)
    # an optimizer step inside the block changes the weights, not .grad: the record is made, and
    # its parameter gradients are those of a plain backward
    net.zero_grad(set_to_none=True)
    ref = copy.deepcopy(net)
    _loss(ref(x)).backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with hs.record(net, tmp_path / "b"):
        _loss(net(x)).backward()
        opt.step()
    params = torch.load(tmp_path / "b" / "params.pt")
    for n, p in ref.named_parameters():
        assert torch.equal(params[n], p.grad)


# -- the report's plain data -----------------------------------------------------------------------
def test_to_dict_is_strict_json_for_an_infinite_loss_and_nan_errors():
    """to_dict promised JSON-serialisable data with 'inf' for infinite errors, yet an infinite
    loss went out as the float inf (json.dumps writes Infinity: not JSON)."""
    net, x = _net()
    net = net[:3]  # the last Linear's output is the model's: an infinite bias makes the loss inf
    bad = copy.deepcopy(net)
    with torch.no_grad():
        bad[2].bias[0] = float("inf")
    report = hs.compare(net, bad, x, loss_fn=_loss)
    assert report.culprit == "2"
    d = report.to_dict()
    text = json.dumps(d, allow_nan=False)  # strict JSON
    assert json.loads(text)["loss"] == [pytest.approx(float(_loss(net(x)).detach())), "inf"]
    assert report.loss is not None and report.loss[1] == float("inf")
    row = next(r for r in d["rows"] if r["name"] == "2")
    assert row["local_error"] == "inf"
