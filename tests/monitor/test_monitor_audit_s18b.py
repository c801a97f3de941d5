"""Audit s18b of the Monitor: each record equals a reference computed by hand from the training
forward alone."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _reference(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict]:
    """Each layer's output statistics and output-gradient norm, by a plain hook on a copy."""
    outs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, output) -> None:
            output.retain_grad()
            outs[name] = output

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in net.named_children()]
    try:
        ((net(x) - y) ** 2).mean().backward()
    finally:
        for h in handles:
            h.remove()
    net.zero_grad(set_to_none=True)
    return {
        n: {
            "mean": o.mean().item(),
            "std": o.std().item(),
            "absmax": o.abs().max().item(),
            "grad_norm": o.grad.norm().item(),
        }
        for n, o in outs.items()
    }


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_evaluation_forward_inside_a_step_is_not_a_micro_batch(mode):
    """A forward under no_grad/inference_mode inside a logged step (a validation batch) trains
    nothing; it was counted as a micro-batch, so the layers' activation statistics mixed the
    evaluation batch into the training one (absmax 163 instead of 1.8), silently."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    big = torch.randn(16, 4) * 100
    net = _net()
    ref = _reference(net, x, y)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with hs.Monitor(net, alerts="off") as mon:
        with ctx():
            net(big)  # before the training forward
        ((net(x) - y) ** 2).mean().backward()
        with ctx():
            net(big)  # and after it
        opt.step()
        rec = mon.step(opt)
        opt.zero_grad()
    assert sorted(rec.layers) == ["0", "1", "2"]  # no "0#1": the evaluations are not calls
    for name, want in ref.items():
        for stat, v in want.items():
            assert _close(rec.layers[name][stat], v), (name, stat, rec.layers[name][stat], v)


def test_no_grad_inside_the_forward_and_reentrant_checkpointing_are_still_training():
    """What stays recorded: a frozen part the model's own forward runs under no_grad, and a
    reentrant checkpoint of the whole model (its first forward runs under no_grad)."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _net()

        def forward(self, x):
            with torch.no_grad():
                h = self.body[0](x)
            return self.body[2](self.body[1](h))

    torch.manual_seed(1)
    x = torch.randn(8, 4)
    net = Frozen()
    want = net.body[0](x)
    with hs.Monitor(net, alerts="off") as mon:
        net(x).sum().backward()
        rec = mon.step()
    assert _close(rec.layers["body.0"]["absmax"], want.abs().max().item())

    net2 = _net()
    y = torch.zeros(8, 2)
    ref = _reference(net2, x, y)
    with hs.Monitor(net2, alerts="off") as mon:
        out = checkpoint(net2, x.requires_grad_(), use_reentrant=True)
        ((out - y) ** 2).mean().backward()
        rec = mon.step()
    for name, stats in ref.items():
        for stat, v in stats.items():
            assert _close(rec.layers[name][stat], v), (name, stat)


def test_a_step_with_only_an_evaluation_warns_naming_no_grad():
    net = _net()
    with hs.Monitor(net, alerts="off") as mon:
        with torch.no_grad():
            net(torch.randn(2, 4))
        with pytest.warns(hs.MonitorWarning, match="no_grad"):
            rec = mon.step()
    assert rec.layers == {}
    with hs.Monitor(net, alerts="off") as mon, warnings.catch_warnings():
        warnings.simplefilter("error")
        net(torch.randn(2, 4)).sum().backward()
        assert sorted(mon.step().layers) == ["0", "1", "2"]


def test_output_gradients_scaled_by_a_grad_scaler_are_reported_unscaled_not_inf():
    """A GradScaler's scale (here 2**100) makes output gradients whose fp32 sum of squares
    overflows although every value is finite: the unscaled norm read inf (the true one 0.44),
    with NumPy's overflow warning leaking out; those blocks are summed in float64."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    net = _net()
    ref = _reference(net, x, y)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with hs.Monitor(net, scaler=scaler, alerts="off") as mon:
            scaler.scale(((net(x) - y) ** 2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            rec = mon.step(opt)
    assert rec.skipped is False  # every gradient finite: the scaler did not skip
    for name, want in ref.items():
        assert _close(rec.layers[name]["grad_norm"], want["grad_norm"]), name


def test_parameters_unfrozen_or_frozen_during_training_are_recorded_as_they_train():
    """Parameters were chosen once, when the Monitor was made: a layer frozen then and unfrozen
    later (fine-tuning) never appeared in any record, and a layer frozen later kept its stale
    zero .grad (zero_grad(set_to_none=False)), reported as grad_norm 0 with a vanishing alert."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    net = _net()
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    recs, norms = [], []
    with hs.Monitor(net, alerts="off") as mon:
        for step in range(4):
            if step == 1:  # unfrozen at the start of step 1: said (no update ratio, below)
                net[0].requires_grad_(True)
            if step == 3:  # frozen again at the start of step 3
                net[0].requires_grad_(False)
            ((net(x) - y) ** 2).mean().backward()
            norms.append(net[0].weight.grad.norm().item() if step in (1, 2) else None)
            before = net[0].weight.detach().clone()
            opt.step()
            moved = (net[0].weight.detach() - before).norm().item() / before.norm().item()
            if step == 1:
                with pytest.warns(hs.MonitorWarning, match="'0.weight', '0.bias' set to train"):
                    recs.append(mon.step(opt))
            else:
                recs.append(mon.step(opt))
            opt.zero_grad(set_to_none=False)
    assert "0.weight" not in recs[0].params
    assert _close(recs[1].params["0.weight"]["grad_norm"], norms[1])
    assert "update_ratio" not in recs[1].params["0.weight"]  # no snapshot: it was frozen
    assert _close(recs[2].params["0.weight"]["grad_norm"], norms[2])
    assert recs[2].params["0.weight"]["weight_norm"] > 0
    assert "grad_norm" not in recs[3].params["0.weight"]  # a stale zero is no gradient
    assert recs[3].params["0.weight"]["update_ratio"] == 0.0 == moved
    assert not any("0.weight" in a.message for r in recs for a in r.alerts)
