"""Audit s20 of the monitor's alerts and sinks: each alert checked against the statistic
computed by hand with plain hooks on both sides of its threshold; each sink read back."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _hand_grad_norms(net: nn.Module, x: torch.Tensor, scale: float) -> dict[str, float]:
    """Output-gradient norms of ``net``'s children from plain tensor hooks (removed after)."""
    norms: dict[str, float] = {}
    handles = []
    for name, m in net.named_children():

        def fwd(_m, _i, out, name=name):
            out.register_hook(lambda g: norms.__setitem__(name, float(g.double().norm())))

        handles.append(m.register_forward_hook(fwd))
    try:
        (net(x).sum() * scale).backward()
    finally:
        for h in handles:
            h.remove()
    net.zero_grad()
    return norms


@pytest.mark.parametrize("scale", [math.inf, math.nan])
def test_non_finite_gradient_norms_alert(scale: float) -> None:
    """An inf or NaN loss gave every layer an inf/NaN output-gradient norm and every parameter
    an inf/NaN gradient norm in the record, and no alert at all: ``exploding`` skipped
    non-finite norms (inf > 1e3 is documented to alert) and ``nonfinite`` looked at outputs
    only. Now one ``nonfinite`` alert names the first (model order) and lists them all."""
    net, x = _net(), torch.randn(8, 3)
    hand = _hand_grad_norms(net, x, scale)
    assert hand and not any(math.isfinite(v) for v in hand.values())
    with hs.Monitor(net, alerts="off") as mon:
        (net(x).sum() * scale).backward()
        rec = mon.step()
        net.zero_grad()
    got = {n: s["grad_norm"] for n, s in rec.layers.items()}
    assert got.keys() == hand.keys()
    assert all(str(got[n]) == str(hand[n]) for n in hand)
    (a,) = [a for a in rec.alerts if a.kind == "nonfinite"]
    bad = [n for n in rec.layers if not math.isfinite(rec.layers[n]["grad_norm"])]
    bad += [n for n, s in rec.params.items() if not math.isfinite(s["grad_norm"])]
    assert (a.layer, a.step, a.values["layers"]) == ("0", 0, bad)
    assert "non-finite gradients" in a.message and "sentinel=True" in a.message
    # finite norms on both sides of `exploding` stay as they were
    with hs.Monitor(net, alerts="off", thresholds={"exploding": 1e30}) as mon:
        (net(x).sum() * 1e3).backward()
        rec = mon.step()
        net.zero_grad()
    assert not rec.alerts


def _mlflow_history(mlflow, run_id: str) -> dict[str, list[tuple[int, float]]]:
    c = mlflow.tracking.MlflowClient()
    keys = c.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in c.get_metric_history(run_id, k)] for k in keys}


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_mlflow_sink_writes_inf_as_inf(tmp_path, monkeypatch) -> None:
    """MlflowSink logged +-inf as NaN ("some stores refuse" it), so an exploding layer's inf
    gradient norm read back from MLflow as NaN, and -inf as NaN too. MLflow 3 takes +-inf: the
    file store keeps it exactly; the database stores keep +-1.8e308, which now warns naming the
    tag."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    rec = hs.MonitorRecord(
        5,
        {"fc": {"grad_norm": math.inf, "mean": -math.inf, "std": math.nan, "absmax": 0.25}},
        {"fc.weight": {"grad_norm": 1.2345678901234567e300}},
    )
    want = rec.scalars()
    # (an experiment of its own in each store: another test's active experiment, a global of
    # mlflow's, does not exist in these new stores)
    mlflow.set_tracking_uri("file:" + str(tmp_path / "mlruns"))
    with mlflow.start_run(experiment_id=mlflow.create_experiment("inf")) as run:
        hs.MlflowSink()(rec)
    got = _mlflow_history(mlflow, run.info.run_id)
    assert got.keys() == want.keys()
    for k, v in want.items():
        ((step, value),) = got[k]
        assert step == 5 and str(value) == str(v), (k, value, v)
    mlflow.set_tracking_uri("sqlite:///" + str(tmp_path / "m.db"))
    with mlflow.start_run(experiment_id=mlflow.create_experiment("inf")) as run:
        sink = hs.MlflowSink()
        with pytest.warns(hs.HookscopeWarning, match=r"hookscope/fc/grad_norm.*1\.8e308"):
            sink(rec)
        sink(rec)  # said once
    got = _mlflow_history(mlflow, run.info.run_id)
    assert got["hookscope/fc/grad_norm"] == [(5, 1.7976931348623157e308)] * 2


@pytest.mark.parametrize(
    ("act", "lo", "hi"),
    [(nn.Tanh(), -1.0, 1.0), (nn.Sigmoid(), 0.0, 1.0), (nn.Hardtanh(-5, 5), -5, 5)],
)
def test_saturation_band_is_the_margin_times_the_range(
    act: nn.Module, lo: float, hi: float
) -> None:
    """``saturation_margin`` was documented as the distance from the bound, but the monitor
    counts values within ``margin * (high - low)`` of it: Tanh's band at 0.01 is 0.02 wide
    (0.985 counted saturated, 0.015 from 1). The statistic is unchanged; the documentation now
    says the band. Checked against outputs counted by hand on both sides of the band and of
    the ``saturation`` threshold."""
    band = 0.01 * (hi - lo)
    outs = torch.tensor(
        [hi - 0.6 * band, lo + 0.6 * band, hi - 1.4 * band, lo + 1.4 * band, (lo + hi) / 2],
        dtype=torch.float64,
    )
    seen: list[torch.Tensor] = []
    h = act.register_forward_hook(lambda _m, _i, o: seen.append(o.detach().clone()))
    try:
        for keep, th in ((2, 0.4), (2, 0.41)):
            x = torch.full((1,), 0.0, dtype=torch.float64)
            net = nn.Sequential(act)
            pre = outs.clone()
            if isinstance(act, nn.Tanh):
                pre = torch.atanh(outs)
            elif isinstance(act, nn.Sigmoid):
                pre = torch.logit(outs)
            inp = (pre + x).float().requires_grad_()
            with hs.Monitor(net, alerts="off", thresholds={"saturation": th}) as mon:
                net(inp).sum().backward()
                rec = mon.step()
            y = seen[-1].double()
            hand = float(((y - lo <= band) | (hi - y <= band)).double().mean())
            assert hand == keep / 5 == rec.layers["0"]["saturated"]
            fired = [a for a in rec.alerts if a.kind == "saturation"]
            assert bool(fired) == (hand >= th)
    finally:
        h.remove()


def test_a_step_a_grad_scaler_skipped_raises_no_nonfinite_alert():
    """Mixed precision expects a GradScaler to skip a step now and then (its scaled gradients
    overflowed): the record says skipped=True, and no 'nonfinite' alert is raised for its
    gradients; the same gradients without a scaler alert."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with hs.Monitor(net, scaler=scaler) as mon:
        scaler.scale(net(x).pow(2).mean() * float("inf")).backward()
        rec = mon.step(opt)
        scaler.step(opt)
        scaler.update()
    assert rec.skipped is True
    assert not [a for a in rec.alerts if a.kind == "nonfinite"]
    net.zero_grad()
    with hs.Monitor(net) as mon:
        (net(x).pow(2).mean() * float("inf")).backward()
        with pytest.warns(hs.MonitorWarning, match="non-finite gradients"):
            rec = mon.step(opt)
    assert [a.kind for a in rec.alerts if a.kind == "nonfinite"] == ["nonfinite"]
