"""Audit s18e of the monitor's sinks in a training loop: a record reaches each sink with the
values and step it has, and a sink that fails does not shift or corrupt the later records."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _hand_means(net: nn.Sequential, xs: list[torch.Tensor]) -> list[float]:
    """The Tanh output mean of each step, by a plain hook on a copy trained the same way."""
    import copy

    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    got: list[float] = []
    h = ref[1].register_forward_hook(lambda m, a, o: got.append(o.mean().item()))
    try:
        for x in xs:
            ref(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        h.remove()
    return got


def test_a_sink_that_raises_once_does_not_shift_the_later_steps():
    """A sink raising at step 1 (a full disk, a network error) left the step half done: the
    next step() recorded step 1 again, with step 1's stale layer statistics (its hooks were
    gone), and every later record carried the step before its own: [0, 1, 1, 2], silently.
    Now the step completes, the other sinks still get the record, and the error is raised
    after, naming the sink and the step."""
    net = _net()
    xs = [torch.randn(5, 4) for _ in range(4)]
    want = _hand_means(net, xs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls: list[int] = []
    seen: list[int] = []

    def flaky(rec: hs.MonitorRecord) -> None:
        calls.append(rec.step)
        if len(calls) == 2:
            raise OSError("disk full")

    raised = []
    with hs.Monitor(net, sinks=[flaky, lambda r: seen.append(r.step)], alerts="off") as mon:
        for i, x in enumerate(xs):
            net(x).pow(2).mean().backward()
            opt.step()
            try:
                mon.step(opt)
            except OSError as e:
                raised.append((i, "".join(getattr(e, "__notes__", []))))
            opt.zero_grad()
        assert [r.step for r in mon.records] == [0, 1, 2, 3]
        assert mon.step_index == 4
        got = [r.layers["1"]["mean"] for r in mon.records]
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(got, want))
    assert seen == [0, 1, 2, 3]  # the sink after the failing one got every record
    assert calls == [0, 1, 2, 3]
    assert len(raised) == 1 and raised[0][0] == 1
    assert "step 1" in raised[0][1] and "flaky" in raised[0][1]


def test_a_warning_turned_into_an_error_does_not_shift_the_later_steps():
    """Under ``-W error`` an alert raised out of step(), which likewise left the step half done."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, thresholds={"vanishing": 1e9}) as mon:
        for _ in range(2):
            net(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            with pytest.warns(hs.MonitorWarning):
                mon.step(opt)
            opt.zero_grad()
        with pytest.raises(hs.MonitorWarning):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                net(torch.randn(5, 4)).pow(2).mean().backward()
                opt.step()
                mon.step(opt)
        assert [r.step for r in mon.records] == [0, 1, 2]
        assert mon.step_index == 3


def _tb_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def test_tensorboard_sink_writes_the_skipped_flag_and_says_when_float32_overflows(tmp_path):
    """A step its GradScaler skipped has NaN/Inf gradient statistics; the TensorBoard sink wrote
    them without the record's ``skipped`` flag (the other trackers get ``hookscope/skipped``), and
    a finite norm above float32's range (kept in float64 by the monitor) reached TensorBoard,
    which stores float32, as inf, silently. Now ``skipped`` is a scalar and the overflow warns
    naming the tag; NaN/inf are written as they are."""
    pytest.importorskip("tensorboard")
    rec = hs.MonitorRecord(
        3,
        {"fc": {"mean": math.nan, "absmax": math.inf, "grad_norm": 2.5}},
        {"fc.weight": {"grad_norm": 1e39, "weight_norm": 0.75}},
        skipped=True,
    )
    sink = hs.TensorBoardSink(str(tmp_path))
    with pytest.warns(hs.HookscopeWarning, match=r"param_grad_norm/fc\.weight.*1e\+39.*float32"):
        sink(rec)
    sink(hs.MonitorRecord(4, {"fc": {"mean": 0.5}}, skipped=False))
    sink.close()
    got = _tb_scalars(tmp_path)
    assert got["skipped"] == [(3, 1.0), (4, 0.0)]
    assert math.isnan(got["mean/fc"][0][1]) and got["mean/fc"][1] == (4, 0.5)
    assert got["absmax/fc"] == [(3, math.inf)]
    assert got["grad_norm/fc"] == [(3, 2.5)]
    assert got["param_weight_norm/fc.weight"] == [(3, 0.75)]
    assert got["param_grad_norm/fc.weight"] == [(3, math.inf)]


def _wandb_history(folder: str) -> list[dict]:
    """The history rows of the offline W&B run in ``folder`` (the reader of the integration
    tests)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "integrations" / "test_integrations.py"
    spec = importlib.util.spec_from_file_location("_s18e_integrations", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._wandb_history(folder)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")
def test_wandb_sink_says_when_wandb_drops_a_record_logged_below_the_run_step(tmp_path, monkeypatch):
    """A run that already logged its own values (steps 0..4, W&B's auto-increment) then got
    the monitor's records at steps 0 and 1: W&B drops values logged below its current step, so
    the records were not in the run, and nothing in Python said so. Now the sink warns, naming
    the step and the fix (step_offset); with it the records are in the run."""
    pytest.importorskip("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for offset, folder in ((0, tmp_path / "a"), (5, tmp_path / "b")):
        folder.mkdir()
        run = wandb.init(dir=str(folder), project="hookscope-test")
        try:
            for i in range(5):
                run.log({"loss": float(i)})
            sink = hs.WandbSink(run, step_offset=offset)
            recs = [hs.MonitorRecord(s, {"fc": {"mean": 0.25 * s}}) for s in (0, 1)]
            if offset == 0:
                with pytest.warns(hs.HookscopeWarning, match=r"step 0.*run's step 5.*step_offset"):
                    for r in recs:
                        sink(r)
            else:
                for r in recs:
                    sink(r)
        finally:
            run.finish()
        rows = [r for r in _wandb_history(str(folder)) if "hookscope/fc/mean" in r]
        if offset == 0:
            assert rows == []  # what W&B did with them: dropped
        else:
            assert [(r["_step"], r["hookscope/fc/mean"]) for r in rows] == [(5, 0.0), (6, 0.25)]
