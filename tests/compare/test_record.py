"""hs.record: a run written to disk as it goes, compared later (another process) with a live
model or with another record; max_bytes spills what compare keeps to disk."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import KeepsItsInput, plain_step, tiny_models_on_one_thread  # noqa: F401
from helpers.faults import FAULTS, cnn, faulty
from hookscope.compare._store import BUFFER


def _record(model, folder, inputs, kwargs, loss, layers=None):
    with hs.record(model, folder, layers=layers):
        loss(model(*inputs, **kwargs)).backward()
    model.zero_grad(set_to_none=True)


def _rows(r):
    return [
        (x.label, x.error, x.local_error, x.grad_error, x.local_grad_error, x.flagged)
        for x in r.rows
    ]


@pytest.mark.parametrize("fault_id", ["cnn-bn-eps", "cnn-conv1-backward", "cnn-pool-avg"])
def test_a_record_against_a_live_model_gives_the_live_comparison(tmp_path, fault_id):
    fault = next(f for f in FAULTS if f.id == fault_id)
    a, inputs, kwargs, loss = cnn()
    b = faulty(a, fault)
    live = hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
    _record(a, tmp_path, inputs, kwargs, loss)
    rec = hs.compare(str(tmp_path), b, *inputs, loss_fn=loss, **kwargs)
    assert rec.culprit == live.culprit == fault.culprit
    # same errors, except the local parameter-gradient check (it replays A's own modules)
    for x, y in zip(live.rows, rec.rows):
        assert (x.label, x.error, x.local_error, x.grad_error) == (
            y.label,
            y.error,
            y.local_error,
            y.grad_error,
        )
        assert x.flagged == y.flagged


def _record_in_another_process(model, folder, inputs, kwargs, loss) -> None:
    torch.set_num_threads(1)
    _record(model, folder, inputs, kwargs, loss)


def test_a_record_made_in_another_process_compares_with_a_live_bf16_copy(tmp_path):
    a, inputs, kwargs, loss = cnn()

    # a fork server: a fork of this process is unsafe once a test before it started autograd's
    # threads (see helpers.dist.launch)
    mp.set_forkserver_preload(["torch", "hookscope"])
    p = mp.get_context("forkserver").Process(
        target=_record_in_another_process, args=(a, tmp_path, inputs, kwargs, loss)
    )
    p.start()
    p.join(120)
    assert p.exitcode == 0 and (tmp_path / "index.json").exists()
    r = hs.compare(tmp_path, copy.deepcopy(a), *inputs, loss_fn=loss, **kwargs)
    assert r.culprit is None and all(x.local_error == 0 for x in r.rows)
    r = hs.compare(tmp_path, copy.deepcopy(a).to(torch.bfloat16), *inputs, loss_fn=loss, **kwargs)
    assert r.culprit is None
    assert "not stable across dtypes" in r.row("pool").note  # checked on a copy of B in fp32


def test_two_records_give_errors_and_first_divergent_but_no_culprit(tmp_path):
    a, inputs, kwargs, loss = cnn()
    b = faulty(a, next(f for f in FAULTS if f.id == "cnn-act-leaky"))
    live = hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
    _record(a, tmp_path / "a", inputs, kwargs, loss)
    _record(b, tmp_path / "b", inputs, kwargs, loss)
    r = hs.compare(tmp_path / "a", tmp_path / "b")
    assert r.first_divergent == live.first_divergent == "act2"
    assert [(x.label, x.error, x.grad_error) for x in r.rows] == [
        (x.label, x.error, x.grad_error) for x in live.rows
    ]
    assert r.culprit is None and all(x.local_error is None for x in r.rows)
    assert "culprit needs" in r.notes[0] and "live model" in r.notes[0]


def test_the_record_is_written_while_the_run_goes(tmp_path):
    seen = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["files"] = sorted(os.listdir(tmp_path))
            seen["bytes"] = (tmp_path / "values.bin").stat().st_size
            return x

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), Probe())
    x = torch.randn(512, 256)  # 512 KiB a value: more than the spool's buffer holds
    assert x.nbytes > BUFFER
    with hs.record(net, tmp_path):
        net(x).sum().backward()
    # when the second layer runs, the model's input (the first layer's too: one tensor, written
    # once) and the first layer's output are on disk; the buffer holds at most BUFFER bytes
    # besides; no index yet
    assert seen["files"] == ["values.bin"]
    assert seen["bytes"] >= 2 * x.nbytes
    assert {"params.pt", "index.json", "values.bin"} == set(os.listdir(tmp_path))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["version"] == 2
    assert {"in0", "in1", "out1", "in2", "grad1_0", "ingrad2_0"} <= set(index["values"])
    # read back: the first layer's output and gradient are what a plain hook sees
    got = hs.compare(tmp_path, copy.deepcopy(net), x, loss_fn=lambda o: o.sum())
    assert got.culprit is None and got.row("0").error == 0.0 and got.row("0").grad_error == 0.0


def test_what_the_record_holds_in_memory_while_the_run_goes_is_bounded_by_its_buffer(tmp_path):
    seen = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["bytes"] = (tmp_path / "values.bin").stat().st_size
            return x

    torch.manual_seed(0)
    layers = [nn.Linear(128, 128) for _ in range(200)]
    net = nn.Sequential(*layers, Probe())  # 200 calls writing 4 KiB each before the probe
    with hs.record(net, tmp_path):
        net(torch.randn(8, 128)).sum().backward()
    index = json.loads((tmp_path / "index.json").read_text())
    probe = next(c for c, e in enumerate(index["calls"]) if e["name"] == "200")
    before = [
        at + n
        for key, (at, n) in index["values"].items()
        if key.startswith(("in", "out")) and not key.startswith("ingrad")
        and int(key.removeprefix("in").removeprefix("out")) < probe
    ]  # fmt: skip
    assert max(before) > 2 * BUFFER  # more was written before the probe than the buffer holds
    assert 0 < max(before) - seen["bytes"] <= BUFFER


def _v1_reference(folder, model, x, loss):
    """Per recorded call of a format-1 record (one torch.save file per value), the relative error
    of a live run's output and output gradient against the file's, by hand (plain forward hooks,
    tensor hooks, float64 norms): the values a comparison with that record must give. The record
    was made on another machine: its float32 values may differ from this machine's in the last
    bits (another vector width), so the reference is this run's, not 0."""
    index = json.loads((folder / "index.json").read_text())
    modules = dict(model.named_modules())
    live: dict[str, list] = {}
    handles = []
    for name, m in modules.items():

        def hook(mod, args, out, name=name):
            got = live[name] = [out.detach().clone(), None]
            if out.requires_grad:
                out.register_hook(lambda g: got.__setitem__(1, g.detach().clone()))

        handles.append(m.register_forward_hook(hook))
    try:
        loss(model(x)).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)

    def rel(ref, got):
        ref, got = ref.double(), got.double()
        return float((got - ref).norm() / ref.norm()) if ref.norm() > 0 else float(got.norm())

    out = {}
    for pos, call in enumerate(index["calls"]):
        mine = live[call["name"]]
        grad = folder / f"grad{pos}_0.pt"
        out[call["name"]] = (
            rel(torch.load(folder / f"out{pos}.pt"), mine[0]),
            rel(torch.load(grad), mine[1]) if grad.exists() else None,
        )
    return out


def test_a_record_of_format_1_is_still_read():
    """hookscope before the single-file format wrote one torch.save file per value; such a record
    (made then, kept in tests/helpers/records) compares with a live model as before."""
    folder = Path(__file__).parent.parent / "helpers" / "records" / "mlp_v1"
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.LayerNorm(8))
    x = torch.randn(4, 8)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    same = hs.compare(folder, copy.deepcopy(a), x, loss_fn=loss)
    assert same.culprit is None
    ref = _v1_reference(folder, copy.deepcopy(a), x, loss)
    assert len(same.rows) == len(ref) == 5
    for r in same.rows:  # the files read as written: the hand-made errors (0 where bit-equal)
        assert r.error == pytest.approx(ref[r.name][0], rel=1e-4, abs=1e-30), r.name
        assert r.grad_error == pytest.approx(ref[r.name][1], rel=1e-4, abs=1e-30), r.name
        assert r.error < 1e-6  # the same model: last bits at most
    # (the gradients are not small on every machine: the loss on a LayerNorm's output, sum(o^2),
    # is nearly constant, its gradient mostly rounding, which the culprit's check explains)
    b = copy.deepcopy(a)
    b[3].eps = 0.5
    assert hs.compare(folder, b, x, loss_fn=loss).culprit == "3"


def test_a_record_of_format_1_lacking_gradients_after_in_place_ops_is_compared_where_it_has_them(
    tmp_path,
):
    """The earlier format lost the gradient of a module's output when an in-place op followed it
    (its identity views' hooks never fired): such a record (made then, kept in
    tests/helpers/records) is compared where both runs have a gradient, says so, and names no
    culprit against the same model; a fault is still named."""
    folder = Path(__file__).parent.parent / "helpers" / "records" / "relu_inplace_v1"
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    same = hs.compare(folder, copy.deepcopy(a), x, loss_fn=loss)
    assert same.culprit is None
    assert same.row("0").grad_error is None  # the record has none: not compared, not zero
    ref = _v1_reference(folder, copy.deepcopy(a), x, loss)
    assert ref["2"][1] < 1e-6  # the same model: last bits at most (0 on the recording machine)
    assert same.row("2").grad_error == pytest.approx(ref["2"][1], rel=1e-4, abs=1e-30)
    assert any("earlier format" in n and "in-place" in n for n in same.notes)
    b = copy.deepcopy(a)
    b[2].weight.data.mul_(1.1)
    assert hs.compare(folder, b, x, loss_fn=loss).culprit == "2"
    with hs.record(a, tmp_path / "r"):
        a(x).pow(2).sum().backward()
    a.zero_grad(set_to_none=True)
    now = hs.compare(tmp_path / "r", copy.deepcopy(a), x, loss_fn=loss)
    assert now.culprit is None and now.row("2").grad_error == 0.0
    assert not any("earlier format" in n for n in now.notes)
    # the current format takes that gradient (and the ReLU's input gradient) from the graph's own
    # nodes (PyTorch drops a hook on a view changed in place): nothing lost, compared exactly
    assert not any("no gradient recorded" in n for n in now.notes)
    assert now.row("0").grad_error == 0.0 and now.row("1").local_grad_error == 0.0


def test_a_record_of_some_layers_still_names_the_culprit(tmp_path):
    a, inputs, kwargs, loss = cnn()
    b = faulty(a, next(f for f in FAULTS if f.id == "cnn-conv-reflect"))
    _record(a, tmp_path, inputs, kwargs, loss, layers=["", "conv1", "conv2", "fc"])
    r = hs.compare(tmp_path, b, *inputs, loss_fn=loss, **kwargs)
    assert [x.label for x in r.rows] == ["<root>", "conv1", "conv2", "fc"]
    assert r.culprit == "conv2"
    assert sorted(r.unmatched)[:2] == ["b: act1#0", "b: act2#0"]
    # the verdict's scope is said: the calls not recorded are not looked at
    assert any("culprit is looked for among the paired calls only" in n for n in r.notes)


def test_other_inputs_than_the_recorded_ones_are_refused(tmp_path):
    a, inputs, kwargs, loss = cnn()
    _record(a, tmp_path, inputs, kwargs, loss)
    with pytest.raises(hs.CompareError, match="inputs given differ"):
        hs.compare(tmp_path, copy.deepcopy(a), inputs[0] + 1, loss_fn=loss)


def test_a_record_is_single_use_and_never_overwrites_one(tmp_path):
    a, inputs, _, _ = cnn()
    rec = hs.record(a, tmp_path)
    with rec:
        a(*inputs)
    with pytest.raises(hs.ScopeReusedError), rec:
        pass
    with pytest.raises(hs.CompareError, match="already holds a record"), hs.record(a, tmp_path):
        pass
    with pytest.raises(hs.CompareError, match="not a record"):
        hs.compare(tmp_path / "nothing", a, *inputs)


def test_max_bytes_spills_to_disk_and_gives_the_same_report():
    a, inputs, kwargs, loss = cnn()
    b = faulty(a, next(f for f in FAULTS if f.id == "cnn-fc-weights")).to(torch.bfloat16)
    full = hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
    spilled = hs.compare(a, b, *inputs, loss_fn=loss, max_bytes=4096, **kwargs)
    assert _rows(spilled) == _rows(full) and spilled.culprit == "fc"


def test_the_recorded_run_is_the_run_without_hookscope(tmp_path):
    """A residual kept from before an in-place ReLU (the ReLU changes it too): the step inside
    hs.record gives the output and parameter gradients of the step without it (identity views,
    not aliases, so the in-place op still updates the tensor's autograd history)."""
    torch.manual_seed(0)
    m = KeepsItsInput()
    x = torch.randn(3, 4)
    out_ref, ref = plain_step(m, x)
    with hs.record(m, tmp_path / "r"):
        out = m(x)
        out.pow(2).sum().backward()
    assert torch.equal(out, out_ref)
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


@pytest.mark.parametrize("name", ["params.pt", "index.json.tmp"])
def test_a_file_of_the_user_s_under_a_name_the_record_writes_is_refused_not_replaced(
    tmp_path, name
):
    """A checkpoint saved as params.pt in the folder was replaced by the record's gradients:
    refused before anything is written, the file kept as it was."""
    net = nn.Sequential(nn.Linear(4, 4))
    (tmp_path / name).write_bytes(b"the user's")
    refused = pytest.raises(hs.CompareError, match=rf"already holds {name}, a file the record")
    with refused, hs.record(net, tmp_path):
        net(torch.randn(2, 4)).sum().backward()
    assert (tmp_path / name).read_bytes() == b"the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_two_records_of_runs_on_other_inputs_are_refused_and_an_fp32_and_a_bf16_record_are_not(
    tmp_path,
):
    """Two records made on inputs that differ in one element were compared silently (every
    row differed, the first layer named where the runs drift): refused, naming the difference.
    An fp32 record and a bf16 one of the same inputs (each cast to its model's dtype) compare."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    other = x.clone()
    other[0, 0] += 1.0
    loss = lambda o: o.float().pow(2).sum()  # noqa: E731
    for name, model, inputs in [
        ("a", net, x),
        ("b", net, other),
        ("low", copy.deepcopy(net).to(torch.bfloat16), x),
    ]:
        with hs.record(model, tmp_path / name):
            loss(model(inputs.to(next(model.parameters()).dtype))).backward()
        model.zero_grad(set_to_none=True)
    with pytest.raises(hs.CompareError, match=r"two records were made on different inputs"):
        hs.compare(tmp_path / "a", tmp_path / "b")
    report = hs.compare(tmp_path / "a", tmp_path / "low")
    assert report.first_divergent is None and report.dtypes == ("float32", "bfloat16")


def test_a_loss_term_on_the_weights_is_noted_by_the_record_and_left_out_of_the_comparison(
    tmp_path,
):
    """A record made with weight decay written into the loss (``loss + wd * sum(p^2)``), against
    a live copy compared with the plain loss: every module owning a weight was named (its
    parameter gradients against A's .grad, which holds the decay's share). The record notes the
    parameters used outside the model's call (not those used only inside it), and those are
    left out of the comparison with a note; a fault is still named."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    with hs.record(net, tmp_path / "wd"):
        decay = sum(p.pow(2).sum() for n, p in net.named_parameters() if n.endswith("weight"))
        (loss(net(x)) + 1e-2 * decay).backward()
    net.zero_grad(set_to_none=True)
    index = json.loads((tmp_path / "wd" / "index.json").read_text())
    assert index["outside"] == ["0.weight", "1.weight", "3.weight"]
    same = hs.compare(tmp_path / "wd", copy.deepcopy(net), x, loss_fn=loss)
    assert same.culprit is None
    assert "gradients of 0.weight not compared" in same.row("0").note
    b = copy.deepcopy(net)
    with torch.no_grad():
        b[3].weight.mul_(1.01)
    assert hs.compare(tmp_path / "wd", b, x, loss_fn=loss).culprit == "3"
    with hs.record(net, tmp_path / "plain"):  # no term: nothing outside
        loss(net(x)).backward()
    assert json.loads((tmp_path / "plain" / "index.json").read_text())["outside"] == []
    assert torch._C._len_torch_function_stack() == 0  # the record's mode is gone


class _SquaredSum(torch.autograd.Function):
    """``(w * w).sum()`` as a custom autograd Function (a fused weight-decay kernel): its forward
    runs with gradients off, so no torch function shows the parameter being used."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return (w * w).sum()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return 2 * w * g


@pytest.mark.parametrize("start", ["Tensor.backward", "autograd.backward", "autograd.grad"])
def test_the_loss_is_walked_however_its_backward_starts(tmp_path, start):
    """The walk runs for ``loss.backward()``, ``torch.autograd.backward`` and
    ``torch.autograd.grad``, whose arguments (the parameters asked for) are not uses: only the
    weight the term reaches is noted (every parameter was, under torch.autograd.grad)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with hs.record(net, tmp_path / "r"):
        loss = net(torch.randn(3, 4)).sum() + 0.1 * _SquaredSum.apply(net[0].weight)
        if start == "Tensor.backward":
            loss.backward()
        elif start == "autograd.backward":
            torch.autograd.backward(loss)
        else:
            torch.autograd.grad(loss, list(net.parameters()))
    assert json.loads((tmp_path / "r" / "index.json").read_text())["outside"] == ["0.weight"]


def test_a_loss_term_through_a_custom_autograd_function_is_noted_too(tmp_path):
    """The term on a weight computed by a custom autograd Function: the record walks the loss's
    graph when its backward starts, up to the model's output, and notes every parameter reached
    on the way (it named the fault-free owner as the culprit: its gradient held the term)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    with hs.record(net, tmp_path / "fn"):
        (loss(net(x)) + 0.1 * _SquaredSum.apply(net[0].weight)).backward()
    net.zero_grad(set_to_none=True)
    assert json.loads((tmp_path / "fn" / "index.json").read_text())["outside"] == ["0.weight"]
    same = hs.compare(tmp_path / "fn", copy.deepcopy(net), x, loss_fn=loss)
    assert same.culprit is None and "not compared" in same.row("0").note
    b = copy.deepcopy(net)
    with torch.no_grad():
        b[2].weight.mul_(1.01)
    assert hs.compare(tmp_path / "fn", b, x, loss_fn=loss).culprit == "2"


class _Keeps(nn.Sequential):
    """Keeps its first layer's output (a value a module call handed on) for the loss."""

    def forward(self, x):
        self.kept = self[0](x)
        return self[2](self[1](self.kept))


def test_a_loss_on_an_activation_the_model_kept_is_said_not_blamed(tmp_path):
    """A loss term on an activation the model kept (an auxiliary loss): the loss's graph walk
    stops at values module calls handed on, so ``0.weight`` is not a use outside (``0``'s
    recorded output gradient holds the term, and its replay counts it), but the model's own
    call cannot give that path back from its output gradient: its row has no local gradient
    error and says why (it was named as the culprit of a fault-free copy); a fault elsewhere is
    still named."""
    torch.manual_seed(0)
    net = _Keeps(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    with hs.record(net, tmp_path / "kept"):
        out = net(x)
        (loss(out) + net.kept.pow(2).sum()).backward()
    net.zero_grad(set_to_none=True)
    del net.kept  # (a non-leaf tensor: deepcopy refuses it)
    index = json.loads((tmp_path / "kept" / "index.json").read_text())
    assert index["outside"] == [] and index["loss_inside"] == [1]  # call 1: "0"
    report = hs.compare(tmp_path / "kept", copy.deepcopy(net), x, loss_fn=loss)
    assert report.culprit is None and report.row("0").local_grad_error == 0.0
    root = report.row("")
    assert root.local_grad_error is None and "auxiliary term" in root.note
    b = copy.deepcopy(net)
    with torch.no_grad():
        b[2].weight.mul_(1.01)
    assert hs.compare(tmp_path / "kept", b, x, loss_fn=loss).culprit == "2"


def test_no_parameter_gradient_error_where_a_run_has_no_backward(tmp_path):
    """A record made without backward compared with one made with it (or with a live model and
    no loss_fn): there are no gradients to compare, so param_grad_error is None, as grad_error
    is (it read 1.0 or inf on a fault-free pair)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with hs.record(net, tmp_path / "bwd"):
        net(x).pow(2).mean().backward()
    net.zero_grad(set_to_none=True)
    with hs.record(net, tmp_path / "fwd"):
        net(x)
    for report in (
        hs.compare(tmp_path / "bwd", copy.deepcopy(net), x),
        hs.compare(tmp_path / "fwd", tmp_path / "bwd"),
    ):
        assert [r.param_grad_error for r in report.rows] == [None] * 4
        assert [r.grad_error for r in report.rows] == [None] * 4
        assert report.first_divergent is None and report.row("2").error == 0.0


def test_a_record_of_another_model_is_said_to_pair_only_the_root(tmp_path):
    """A record of one model compared with another whose modules share no name: only the roots
    pair, and the verdict named the root with nothing but the generic unmatched note; now a
    warning and a note name both models and their modules."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with hs.record(net, tmp_path):
        net(x).pow(2).mean().backward()

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 2)

        def forward(self, x):
            return self.body(x)

    with pytest.warns(hs.HookscopeWarning, match="look like two different models") as info:
        report = hs.compare(tmp_path, Other(), x, loss_fn=lambda o: o.pow(2).mean())
    msg = str(info[0].message)
    assert "Sequential" in msg and "Other" in msg and "'body'" in msg and "'0'" in msg
    assert any("look like two different models" in n for n in report.notes)


def test_a_check_that_cannot_replay_is_said_as_such_not_as_a_row_without_local_error(tmp_path):
    """B's module patched with an instance forward that calls the original (bf16) module: the
    check of dtypes replays a copy in A's dtype, which fails. The row's own replay worked (it is
    flagged, with its local error), yet the warning said its row had no local error and listed
    it twice. Now only the check is said to have failed, in the row's note."""
    import warnings

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    loss = lambda o: o.float().pow(2).mean()  # noqa: E731
    with hs.record(a, tmp_path):
        loss(a(x)).backward()
    b = copy.deepcopy(a).to(torch.bfloat16)
    with torch.no_grad():
        b[2].weight.mul_(1.5)
    lin = b[2]
    b[2].forward = lambda h: torch.nn.functional.linear(h, lin.weight, lin.bias)  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = hs.compare(tmp_path, b, x, loss_fn=loss)
    assert r.culprit == "2" and r.row("2").local_error is not None
    assert not any("could not replay" in str(w.message) for w in seen)


def test_the_record_holds_no_autograd_graph_after_its_block(tmp_path):
    """A forward-only record (no backward frees the graph): the nodes the loss's walk stops at
    are dropped when the block ends, so the run's saved activations are not held as long as
    the record object is."""
    import gc
    import weakref

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    x = torch.randn(3, 4)
    saved = weakref.ref(x)  # the first layer saves its input for the weight's gradient
    rec = hs.record(net, tmp_path / "r")
    with rec:
        out = net(x)
    del out, x
    gc.collect()
    assert saved() is None


def test_a_record_whose_block_stepped_the_optimizer_refuses_the_stepped_model(tmp_path):
    """``optimizer.step()`` inside the with block: the record holds the run of the weights
    before the step, the model after the block holds new ones. Compared with that model every
    layer differed and the first was named, silently; the record keeps a checksum of the
    stepped parameters and the comparison refuses the model holding them, naming the fix. A
    copy made before the step compares exactly; a record made without a step notes nothing."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    before = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    with hs.record(net, tmp_path / "step"):
        loss(net(x)).backward()
        opt.step()
    net.zero_grad(set_to_none=True)
    index = json.loads((tmp_path / "step" / "index.json").read_text())
    assert sorted(index["moved"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    with pytest.raises(hs.CompareError, match=r"changed inside its with block.*copy made before"):
        hs.compare(tmp_path / "step", net, x, loss_fn=loss)
    report = hs.compare(tmp_path / "step", before, x, loss_fn=loss)
    assert report.culprit is None and all(r.error == 0.0 for r in report.rows)
    with hs.record(before, tmp_path / "plain"):
        loss(before(x)).backward()
    assert json.loads((tmp_path / "plain" / "index.json").read_text())["moved"] == {}
    assert hs.compare(tmp_path / "step", tmp_path / "plain").first_divergent is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_stepped_record_refuses_a_copy_of_the_stepped_model_in_another_dtype(tmp_path, dtype):
    """The checksum of the stepped parameters covered their own dtype only: a bf16 (fp16, fp64)
    copy of the model after the step was compared as if it were the recorded run's model, and
    every layer's weights differing named a culprit, silently. The record now keeps the
    checksums of the new values cast to the other floating dtypes: such a copy is refused as
    the stepped model; a copy in that dtype made before the step is compared (no culprit)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    before = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    loss = lambda o: o.float().pow(2).sum()  # noqa: E731
    with hs.record(net, tmp_path / "step"):
        loss(net(x)).backward()
        opt.step()
    net.zero_grad(set_to_none=True)
    index = json.loads((tmp_path / "step" / "index.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert sorted(index["moved_cast"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # the checksum itself, by hand: CRC-32 of the cast values' bytes, seeded with dtype and shape
    w = net[0].weight.detach().to(dtype)
    raw = w.view(torch.int16 if w.element_size() == 2 else torch.int64).numpy().tobytes()
    assert index["moved_cast"]["0.weight"][name] == zlib.crc32(
        raw, zlib.crc32(f"{dtype}{tuple(w.shape)}".encode())
    )
    with pytest.raises(hs.CompareError, match=r"changed inside its with block.*copy made before"):
        hs.compare(tmp_path / "step", copy.deepcopy(net).to(dtype), x, loss_fn=loss)
    report = hs.compare(tmp_path / "step", copy.deepcopy(before).to(dtype), x, loss_fn=loss)
    assert report.culprit is None
