"""Monitor diagnosis: vanishing, exploding, dead units, saturation; thresholds; warnings and logs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def one_step(net, x, mon, scale=1.0):
    (net(x).pow(2).mean() * scale).backward()
    rec = mon.step()
    net.zero_grad()
    return rec


def kinds(rec, kind):
    return [a for a in rec.alerts if a.kind == kind]


def test_dead_units_alert_names_layer_and_fraction():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].bias.fill_(-100.0)
    with (
        hs.Monitor(net, thresholds={"vanishing": 0.0}) as mon,
        pytest.warns(hs.MonitorWarning, match=r"layer .1.: 100.0% of its output is exactly zero"),
    ):
        rec = one_step(net, torch.rand(8, 3), mon)
    (a,) = kinds(rec, "dead")
    assert (a.layer, a.values["zeros"], a.step) == ("1", 1.0, 0)
    # the same with a threshold above 100%: silent
    with hs.Monitor(net, thresholds={"dead": 1.01}, alerts="off") as mon:
        rec = one_step(net, torch.rand(8, 3), mon)
    assert not kinds(rec, "dead")


def test_saturation_alert_for_tanh():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh())
    with torch.no_grad():
        net[0].weight.mul_(1000.0)
    with hs.Monitor(net, alerts="off") as mon:
        rec = one_step(net, torch.randn(32, 3), mon)
    (a,) = kinds(rec, "saturation")
    assert a.layer == "1"
    h = net(torch.zeros(0, 3))  # noqa: F841 - keeps the model used
    assert rec.layers["1"]["saturated"] >= 0.9


def test_exploding_absolute_and_growth():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(4, 3)
    with hs.Monitor(net, alerts="off") as mon:
        rec = one_step(net, x, mon, scale=1e8)
    assert {a.layer for a in kinds(rec, "exploding")} >= {"0", "0.weight"}
    assert all(a.values["grad_norm"] > 1e3 for a in kinds(rec, "exploding"))
    with hs.Monitor(
        net, alerts="off", thresholds=hs.Thresholds(exploding=1e30, growth=50.0)
    ) as mon:
        assert not kinds(one_step(net, x, mon), "exploding")
        rec = one_step(net, x, mon, scale=1000.0)
    grown = kinds(rec, "exploding")
    assert grown and all("grew" in a.message for a in grown)
    assert all(a.values["grad_norm"] / a.values["previous"] > 50 for a in grown)


def test_vanishing_gradient_from_last_to_first_layer(caplog):
    torch.manual_seed(0)
    layers = []
    for _ in range(5):
        lin = nn.Linear(8, 8)
        with torch.no_grad():
            lin.weight.copy_(0.01 * torch.eye(8))
        layers += [lin, nn.Tanh()]
    net = nn.Sequential(*layers)
    with (
        caplog.at_level(logging.WARNING, logger="hookscope.monitor"),
        hs.Monitor(net, alerts="log") as mon,
    ):
        rec = one_step(net, torch.randn(4, 8), mon)
    a = next(a for a in rec.alerts if a.kind == "vanishing" and "output gradient" in a.message)
    assert a.layer == "0" and a.values["last_layer"] == "9"
    assert a.values["grad_norm"] / a.values["last_grad_norm"] < 1e-4
    assert rec.layers["0"]["grad_norm"] == a.values["grad_norm"]
    assert any("vanishes" in r.getMessage() for r in caplog.records)


def test_thresholds_validation_and_alert_modes():
    with pytest.raises(ValueError, match="unknown threshold"):
        hs.Thresholds.make({"dead_units": 0.5})
    with pytest.raises(ValueError, match="alerts must be"):
        hs.Monitor(nn.Linear(2, 2), alerts="loud")  # type: ignore[arg-type]
    assert hs.Thresholds.make(None) == hs.Thresholds()
