"""Audit s19 of the Monitor under torch.distributed and parameter changes: histograms of the
combined batch, update ratios of parameters frozen, unfrozen, replaced or not stepped during a
step, and ranks whose steps are numbered differently. Each record is checked against a reference
computed by hand, or the monitor must say what it cannot record."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, launch

BINS = 16


# -- 1. histograms under torch.distributed: the combined batch's ---------------------------------
def _hist_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _hist_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, generator=g)
    x[9] *= 10.0  # the largest values on rank 1's half: rank 0's own range is narrower
    return x


def _by_hand(net: nn.Sequential, halves: list[torch.Tensor]) -> dict[str, list[float]]:
    """Each layer's output on each half (as each rank computes it), binned together over
    ``[-absmax, absmax]`` of both halves."""
    outs: dict[str, list[torch.Tensor]] = {"0": [], "1": [], "2": []}
    with torch.no_grad():
        for x in halves:
            h = x
            for name, m in net.named_children():
                h = m(h)
                outs[name].append(h.reshape(-1))
    ref = {}
    for name, parts in outs.items():
        v = torch.cat(parts)
        a = float(v.abs().max())
        ref[f"activations/{name}"] = (a, torch.histc(v / a, bins=BINS, min=-1, max=1).tolist())
    return ref


def _hist_worker(rank: int, out: str) -> None:
    net = _hist_net()
    halves = list(_hist_batch().chunk(WORLD))
    with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
        net(halves[rank]).sum().backward()
        rec = mon.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"got": rec.histograms, "ref": _by_hand(net, halves)}, f)


@pytest.mark.distributed
def test_histograms_under_distributed_are_the_combined_batchs(tmp_path):
    """Each rank binned over its own range and the record showed rank 0's counts only (half the
    batch, over rank 0's range): now every rank bins over the combined range (one all_reduce per
    layer call) and the counts are summed: those of one process on the whole batch."""
    out = str(tmp_path / "hist.json")
    launch(_hist_worker, out)
    with open(out) as f:
        saved = json.load(f)
    got, ref = saved["got"], saved["ref"]
    assert got.keys() == ref.keys() == {"activations/0", "activations/1", "activations/2"}
    mine = _by_hand(_hist_net(), list(_hist_batch().chunk(WORLD))[:1])  # rank 0's half alone
    assert mine["activations/0"][0] < ref["activations/0"][0]  # rank 1 holds the largest
    for tag, (a, counts) in ref.items():
        edges, got_counts = got[tag]
        assert got_counts == counts, tag
        assert sum(got_counts) == 12 * (3 if tag.endswith("2") else 8)
        want = [a * (-1 + 2 * (j + 1) / BINS) for j in range(BINS)]
        assert edges == pytest.approx(want, rel=1e-6), tag
    # and one process running the whole batch records the same counts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = _hist_net()
        with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
            net(_hist_batch()).sum().backward()
            one = mon.step()
    finally:
        torch.set_num_threads(threads)
    for tag, (edges, counts) in one.histograms.items():
        assert got[tag][1] == counts, tag
        assert got[tag][0] == pytest.approx(edges, rel=1e-6), tag


def _tp_hist_worker(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    net = parallelize_module(_hist_net(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
        net(_hist_batch()).sum().backward()  # tensor parallel: every rank runs the whole batch
        rec = mon.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"got": rec.histograms, "ref": _by_hand(_hist_net(), [_hist_batch()])}, f)


@pytest.mark.distributed
def test_histograms_under_tensor_parallel_are_the_full_outputs(tmp_path):
    """Tensor parallel: '0' and '1' output shards (their counts add up), '2' a replicated output
    (counted once): the histograms of one process running the model unsplit."""
    out = str(tmp_path / "hist.json")
    launch(_tp_hist_worker, out)
    with open(out) as f:
        saved = json.load(f)
    got, ref = saved["got"], saved["ref"]
    assert got.keys() == ref.keys()
    for tag, (a, counts) in ref.items():
        edges, got_counts = got[tag]
        assert got_counts == counts, tag
        assert edges == pytest.approx([a * (-1 + 2 * (j + 1) / BINS) for j in range(BINS)]), tag


def test_histograms_of_a_step_with_micro_batches_say_they_are_the_first_ones():
    """With gradient accumulation the other statistics cover every micro-batch of the step, but
    the histogram was the first micro-batch's (binned while it ran), unsaid. It still is (the
    later micro-batches' range is not known while the first runs): a warning says so, once, and
    the counts equal the first micro-batch's by hand."""
    net = _hist_net()
    halves = list(_hist_batch().chunk(WORLD))
    with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
        for h in halves:
            net(h).sum().backward()
        with pytest.warns(hs.MonitorWarning, match="histograms are of the first micro-batch"):
            rec = mon.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            for h in halves:
                net(h).sum().backward()
            mon.step()
    ref = _by_hand(net, halves[:1])
    for tag, (a, counts) in ref.items():
        edges, got = rec.histograms[tag]
        assert got == counts, tag
        assert edges == pytest.approx([a * (-1 + 2 * (j + 1) / BINS) for j in range(BINS)]), tag
    both = _by_hand(net, halves)  # the other statistics: both micro-batches'
    assert all(_close(rec.layers[t[12:]]["absmax"], both[t][0]) for t in both)
    assert any(both[t][0] > ref[t][0] for t in both)


def _range_worker(rank: int, out: str) -> None:
    from hookscope.monitor._stats import ranks_absmax

    mine = [2.0, 5.0][rank]
    got = {
        "list": ranks_absmax([0.0, 1.0, mine]),  # CPU statistics: floats
        "tensor": float(ranks_absmax(torch.tensor([0.0, 1.0, mine], dtype=torch.float64))),
        "nan": ranks_absmax([0.0, 1.0, [math.nan, 1.0][rank]]),  # NaN on rank 0 only
    }
    with open(f"{out}{rank}", "w") as f:
        json.dump({k: str(v) for k, v in got.items()}, f)


@pytest.mark.distributed
def test_the_histogram_range_is_every_ranks_largest_absmax_nan_if_any_is_nan(tmp_path):
    """The range each rank bins over: the largest absmax of the ranks, on every rank, from
    host statistics (floats) or device ones (tensors); NaN on every rank where one rank's is NaN
    (as one process's absmax of a batch holding a NaN)."""
    out = str(tmp_path / "range")
    launch(_range_worker, out)
    for rank in range(WORLD):
        with open(f"{out}{rank}") as f:
            assert json.load(f) == {"list": "5.0", "tensor": "5.0", "nan": "nan"}


# -- 2. parameters replaced, unfrozen or not stepped during a step ----------------------------------
def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _x() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(4))


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


def _ratio(after: torch.Tensor, before: torch.Tensor) -> float:
    """The update ratio by hand: ||p_after - p_before|| / ||p_before||."""
    return _norm(after.detach().double() - before.double()) / _norm(before)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _train_step(net: nn.Module, opt: torch.optim.Optimizer, mon: hs.Monitor):
    """One step; returns the record and, per parameter, (gradient, value before, value after)."""
    net(_x()).pow(2).mean().backward()
    seen = {
        n: (p.grad.clone() if p.grad is not None else None, p.detach().clone())
        for n, p in net.named_parameters()
    }
    opt.step()
    rec = mon.step(opt)
    out = {
        n: (g, b, p.detach().clone())
        for (n, p), (g, b) in zip(net.named_parameters(), seen.values())
    }
    opt.zero_grad()
    return rec, out


def test_parameter_replaced_between_logged_steps_is_the_new_one():
    """Parameters were chosen once, when the Monitor was made: one replaced later
    (model.fc.weight = nn.Parameter(...)) was recorded from the old tensor for the rest of the
    run (weight norm of the old tensor, update ratio 0, no gradient). Now each logged step
    records the parameter the model holds: norms and update ratio equal those by hand."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: every value is exact
        with hs.Monitor(net, every=2, stats=("parameters",), alerts="off") as mon:
            _train_step(net, opt, mon)  # step 0, logged
            net[2].weight = nn.Parameter(torch.full((2, 4), 0.5))  # during step 1, not logged
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            _train_step(net, opt, mon)  # step 1; its step() copies step 2's weights
            rec, seen = _train_step(net, opt, mon)  # step 2, logged
    assert rec.step == 2
    for name in ("0.weight", "2.weight", "2.bias"):
        g, before, after = seen[name]
        got = rec.params[name]
        assert _close(got["grad_norm"], _norm(g)), name
        assert _close(got["weight_norm"], _norm(after)), name
        assert _close(got["update_ratio"], _ratio(after, before)), name
        assert got["update_ratio"] > 0, name


def test_parameter_replaced_during_a_logged_step_is_said_and_the_next_step_exact():
    """Replaced after the monitor copied the values before the step: the record showed the old
    tensor (its weight norm, update ratio 0 against its own copy, no gradient), silently. Now
    the record has the new tensor's gradient and weight norms, no update ratio, and a warning
    names the parameter (once); the next step's ratio equals the hand computation."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, stats=("parameters",), alerts="off") as mon:
        _train_step(net, opt, mon)  # step 0
        net[2].weight = nn.Parameter(torch.full((2, 4), 0.5))  # during step 1
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.warns(hs.MonitorWarning, match=r"step 1: parameter\(s\) '2.weight' replaced"):
            rec1, seen1 = _train_step(net, opt, mon)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            net[2].weight = nn.Parameter(torch.full((2, 4), 0.25))  # again, during step 2
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            rec2, _ = _train_step(net, opt, mon)
            rec3, seen3 = _train_step(net, opt, mon)
    g, _, after = seen1["2.weight"]
    assert rec1.params["2.weight"] == pytest.approx(
        {"grad_norm": _norm(g), "weight_norm": _norm(after)}, rel=1e-6
    )
    assert "update_ratio" not in rec2.params["2.weight"]
    assert _close(
        rec1.params["2.bias"]["update_ratio"], _ratio(seen1["2.bias"][2], seen1["2.bias"][1])
    )
    g, before, after = seen3["2.weight"]
    assert rec3.params["2.weight"] == pytest.approx(
        {"grad_norm": _norm(g), "weight_norm": _norm(after), "update_ratio": _ratio(after, before)},
        rel=1e-6,
    )


def test_parameter_unfrozen_during_a_step_is_said_once_and_the_next_step_exact():
    """Unfrozen after the monitor copied the trained weights: the record had no update ratio,
    silently. Now a warning names the parameters (once each); their gradient and weight norms
    equal the hand computation, and the next step has the exact ratio."""
    net = _net()
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # holds every parameter: it steps them all
    with hs.Monitor(net, stats=("parameters",), alerts="off") as mon:
        rec0, _ = _train_step(net, opt, mon)
        net[0].requires_grad_(True)  # during step 1
        with pytest.warns(
            hs.MonitorWarning, match=r"step 1: parameter\(s\) '0.weight', '0.bias' set to train"
        ):
            rec1, seen1 = _train_step(net, opt, mon)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec2, seen2 = _train_step(net, opt, mon)
            net[0].requires_grad_(False)  # frozen during step 3 (its .grad is None): no ratio
            net[0].requires_grad_(True)  # ... and unfrozen again: said already
            rec3, _ = _train_step(net, opt, mon)
    assert "0.weight" not in rec0.params
    for name in ("0.weight", "0.bias"):
        g, _, after = seen1[name]
        assert rec1.params[name] == pytest.approx(
            {"grad_norm": _norm(g), "weight_norm": _norm(after)}, rel=1e-6
        )
        g, before, after = seen2[name]
        assert _close(rec2.params[name]["update_ratio"], _ratio(after, before)), name
        assert _close(rec2.params[name]["grad_norm"], _norm(g)), name
    assert "update_ratio" in rec3.params["0.weight"]  # never left the list: its copy is right


def test_parameter_the_optimizer_does_not_hold_is_said():
    """Unfrozen for fine-tuning but left out of the optimizer (made with the trainable
    parameters of the time): update ratio 0 every step, and nothing said that it never trains.
    The ratio is still 0 (exact: it did not change), and a warning names the parameters, once."""
    net = _net()
    net[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    net[0].requires_grad_(True)  # before the Monitor: its weights are copied every step
    with hs.Monitor(net, stats=("parameters",), alerts="off") as mon:
        with pytest.warns(
            hs.MonitorWarning, match=r"'0.weight', '0.bias' have a gradient but are not"
        ):
            rec0, seen0 = _train_step(net, opt, mon)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec1, _ = _train_step(net, opt, mon)
    for name in ("0.weight", "0.bias"):
        g, before, after = seen0[name]
        assert (
            _ratio(after, before)
            == 0.0
            == rec0.params[name]["update_ratio"]
            == rec1.params[name]["update_ratio"]
        )
        assert _close(rec0.params[name]["grad_norm"], _norm(g))
    assert _close(
        rec0.params["2.weight"]["update_ratio"], _ratio(seen0["2.weight"][2], seen0["2.weight"][1])
    )


def test_module_replaced_after_the_monitor_was_made_is_said():
    """A monitored module replaced (net[2] = nn.Linear(...)): its old parameters were recorded,
    stale, every step. Now they leave the record and a warning says why and what to do."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, stats=("parameters",), alerts="off") as mon:
        _train_step(net, opt, mon)
        net[2] = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.warns(
            hs.MonitorWarning,
            match=r"'2.weight', '2.bias' are no longer parameters of the monitored layers",
        ):
            rec, _ = _train_step(net, opt, mon)
    assert set(rec.params) == {"0.weight", "0.bias"}


class _Scaled(nn.Module):
    """A linear layer and one learned scale, widened to one scale per output during training."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_parameter_resized_during_a_step_is_said_and_the_next_step_exact():
    """p.data = (another shape) after the monitor copied the values before the step: the copy
    (1 value) was broadcast against the new values (4), an update ratio of nothing real,
    silently (a shape that does not broadcast raised a NumPy error). Now the record has the
    gradient and weight norms, no update ratio, a warning naming the parameter (once); the
    next step's ratio equals the hand computation."""
    net = _Scaled()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, layers=[""], stats=("parameters",), alerts="off") as mon:
        _train_step(net, opt, mon)
        net.scale.data = torch.full((4,), 1.5)  # during step 1
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.warns(hs.MonitorWarning, match=r"'scale' changed shape during the step"):
            rec1, seen1 = _train_step(net, opt, mon)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec2, seen2 = _train_step(net, opt, mon)
    g, _, after = seen1["scale"]
    assert rec1.params["scale"] == pytest.approx(
        {"grad_norm": _norm(g), "weight_norm": _norm(after)}, rel=1e-6
    )
    g, before, after = seen1["lin.weight"]
    assert _close(rec1.params["lin.weight"]["update_ratio"], _ratio(after, before))
    g, before, after = seen2["scale"]
    assert rec2.params["scale"] == pytest.approx(
        {"grad_norm": _norm(g), "weight_norm": _norm(after), "update_ratio": _ratio(after, before)},
        rel=1e-6,
    )


# -- 3. ranks' records are joined in call order: the same step, the same layer calls ------------
def _join_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _join_worker(rank: int, out: str, case: str) -> None:
    net = _join_net()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    first = 2 if case == "first_step" and rank == 1 else 0
    said = ""
    recs = []
    try:
        with hs.Monitor(net, stats=("activations",), alerts="off", first_step=first) as mon:
            for step in range(3):
                if case == "skipped" and rank == 1 and step == 0:
                    with warnings.catch_warnings():  # a skipped batch: no forward, still step()
                        warnings.simplefilter("ignore")
                        mon.step()
                    continue
                if case == "order" and rank == 1:  # the same layers, the other order
                    net[0](net[1](x)).sum().backward()
                else:
                    net(x).sum().backward()
                recs.append(mon.step())
    except RuntimeError as e:
        said = str(e)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"said": said, "steps": [r.step for r in recs]}, f)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("first_step", r"recorded different steps together \(steps \[0, 2\] on ranks 0-1\)"),
        ("skipped", r"different layer calls or parameters at step 0 \(vector sizes \[\d+, 0\]"),
        (
            "order",
            r"at step 0 \(vector sizes \[\d+, \d+\], the same sizes but other names or order",
        ),
    ],
)
def test_ranks_whose_records_do_not_join_are_refused(tmp_path, case, want):
    """Each rank numbers its own steps and the ranks' statistics are joined by position: a rank
    whose monitor started at another step had its steps joined with the others' (rank 0's step 0
    with rank 1's step 2), silently; a rank that filed nothing on a logged step skipped the
    collective, so the others joined the step with its next one (and waited, at the end, for a
    collective it never made); a rank running the same layers in another order had layer '0'
    joined with the other rank's '1'. Each now raises on every rank, at that step."""
    out = str(tmp_path / "said.json")
    launch(_join_worker, out, case, timeout=120)
    with open(out) as f:
        got = json.load(f)
    assert got["steps"] == [] and re.search(want, got["said"]), got


def _sentinel_worker(rank: int, out: str) -> None:
    net = nn.parallel.DistributedDataParallel(_join_net())
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    said, steps = "", []
    try:
        # stats=(): the sentinel alone (no record to join), its ranks numbered differently
        with hs.Monitor(net, stats=(), sentinel=True, alerts="off", first_step=rank) as mon:
            for _ in range(2):
                net(x).sum().backward()
                mon.step()
                steps.append(mon.step_index)
    except RuntimeError as e:
        said = str(e)
    with open(f"{out}{rank}", "w") as f:
        json.dump({"said": said, "steps": steps}, f)


@pytest.mark.distributed
def test_sentinel_ranks_at_different_steps_are_refused(tmp_path):
    """The sentinel's ranks exchange what each found, every step, in call order: ranks whose
    monitors count steps differently handed each other the origins of other steps, silently.
    The same all_reduce now carries each rank's step, and a difference raises on every rank."""
    out = str(tmp_path / "sentinel")
    launch(_sentinel_worker, out)
    for rank in range(WORLD):
        with open(f"{out}{rank}") as f:
            got = json.load(f)
        assert got["steps"] == [] and "different steps (from 0 to 1)" in got["said"], got
