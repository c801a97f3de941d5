"""Audit s18e of find_nonfinite inside a training loop: its own forward and backward must leave
the run as it found it, random number generators included."""

from __future__ import annotations

import torch
import torch.nn as nn

import hookscope as hs


class _DropLog(nn.Module):
    """A dropout whose zeros turn into -inf in a log: the NaN/Inf depends on the random mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.drop(self.fc(x)).abs())


def _masks(net: nn.Module, steps: int, probe_at: int | None) -> list[torch.Tensor]:
    """The dropout masks of a short train-mode loop; find_nonfinite called before step
    ``probe_at``."""
    torch.manual_seed(5)
    out = []
    for k in range(steps):
        if k == probe_at:
            assert hs.find_nonfinite(net, torch.ones(4, 3)) is not None
        out.append(torch.isinf(net(torch.ones(4, 3))).detach())
    return out


def test_find_nonfinite_leaves_the_random_number_generator_as_it_found_it():
    """find_nonfinite runs the model in the mode it is in: in train mode its dropout drew from
    the global generator, so a training loop that called it (after a NaN step, say) went on with
    other dropout masks, data order and initialisations than the same loop without the call,
    silently. Now it draws from a fork of the generators: the loop's masks are those of the loop
    without the call."""
    torch.manual_seed(0)
    net = _DropLog().train()
    want = _masks(net, 3, None)
    got = _masks(net, 3, probe_at=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    hs.find_nonfinite(net, torch.ones(4, 3))
    assert torch.equal(torch.get_rng_state(), before)


def _step(net: nn.Module, opt: torch.optim.Optimizer, mon: hs.Monitor, x: torch.Tensor):
    net(x).sum().backward()
    opt.step()
    rec = mon.step(opt)
    opt.zero_grad()
    return rec


def test_the_sentinel_leaves_out_evaluations_as_the_records_do():
    """A validation batch with a NaN, run between steps while the monitor is paused (what the
    trainer callbacks do) or under no_grad inside a step, was reported by the sentinel as the
    next training step's NaN origin ("step 1: NAN first produced ... by <input>"), though the
    training forward and backward stayed finite, and though the records leave those passes
    out, silently wrong. Now evaluations are left out; a training NaN is still found."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bad = torch.ones(2, 3)
    bad[0, 0] = float("nan")
    with hs.Monitor(net, sentinel=True, alerts="off") as mon:
        assert _step(net, opt, mon, torch.ones(2, 3)).nonfinite is None
        mon.pause()
        with torch.no_grad():
            assert torch.isnan(net(bad)).any()
        mon.resume()
        assert _step(net, opt, mon, torch.ones(2, 3)).nonfinite is None
        with torch.no_grad():  # an evaluation inside the step, not paused
            net(bad)
        assert _step(net, opt, mon, torch.ones(2, 3)).nonfinite is None
        # a training NaN after an evaluation: still found, at its layer
        with torch.no_grad():
            net(bad)
            net[2].bias.fill_(float("inf"))
        origin = _step(net, opt, mon, torch.ones(2, 3)).nonfinite
        assert origin is not None and origin.layer == "2" and origin.phase == "forward"
        assert mon.nonfinite is origin


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, z: torch.Tensor | None = None):
        out = self.a(x) + self.b(y)
        return out if z is None else out + z


def test_a_nonfinite_input_names_its_argument():
    """A NaN in the second argument (or a keyword one) was reported as ``<input>`` with no word
    of which input held it; now the origin names the argument, positional by its parameter
    name, and a training loop's sentinel does the same."""
    net = _Two()
    ok = torch.ones(2, 3)
    bad = torch.ones(2, 3)
    bad[1, 2] = float("nan")
    o = hs.find_nonfinite(net, ok, bad)
    assert (o.layer, o.kind, o.argument) == ("<input>", "nan", "y")
    assert "argument 'y'" in str(o)
    o = hs.find_nonfinite(net, ok, ok, z=bad * float("inf"))
    assert (o.layer, o.argument) == ("<input>", "z")
    o = hs.find_nonfinite(net, bad, ok)
    assert o.argument == "x"
    assert hs.find_nonfinite(net, ok, ok) is None
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, sentinel=True, alerts="off") as mon:
        net(ok, bad).sum().backward()
        opt.step()
        rec = mon.step(opt)
    assert rec is not None and rec.nonfinite is not None and rec.nonfinite.argument == "y"
    assert rec.to_dict()["nonfinite"]["argument"] == "y"
