"""The Monitor says so when it cannot record what it was asked to: arguments it cannot honour are
refused at creation, a logged step in which no monitored layer ran warns."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_monitor_made_in_one_thread_and_stepped_in_another_warns_about_the_first_step():
    """A Monitor built in the main thread and stepped in a worker thread: its first step's hooks
    act on the main thread's calls only, so step 0 records no layer; it warns, naming the thread,
    and later steps (attached by the worker's step()) equal a plain hook's values."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), 0.1)
    mon = hs.Monitor(net, ["0", "2"], alerts="off")
    records, caught, seen = [], [], []
    plain = net[2].register_forward_hook(lambda m, a, o: seen.append(o.detach().abs().max()))

    def train() -> None:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                net(torch.randn(8, 4)).pow(2).sum().backward()
                opt.step()
                records.append(mon.step(opt))
                opt.zero_grad()
        caught.extend(w)

    t = threading.Thread(target=train)
    t.start()
    t.join()
    plain.remove()
    mon.close()
    assert sorted(records[1].layers) == ["0", "2"]
    assert records[1].layers["2"]["absmax"] == pytest.approx(seen[1].item())
    ours = [str(w.message) for w in caught if issubclass(w.category, hs.HookscopeWarning)]
    assert len(ours) == 1, ours
    assert ours[0].startswith("step 0: no monitored layer ran"), ours[0]
    assert "thread" in ours[0]


def test_a_logged_step_in_which_the_model_never_ran_warns():
    """step() with no forward since the last one: the record is empty; it warns (step index)."""
    net = _net()
    with hs.Monitor(net, ["0"], alerts="off") as mon:
        with pytest.warns(hs.MonitorWarning, match=r"^step 0: no monitored layer ran"):
            rec = mon.step()
        assert rec is not None and rec.layers == {}
        net(torch.randn(2, 4)).sum().backward()
        assert sorted(mon.step().layers) == ["0"]  # no warning: the model ran


def test_a_paused_monitor_does_not_warn_about_an_empty_step():
    """Pausing is asking for nothing: an empty step while paused is not reported."""
    net = _net()
    with hs.Monitor(net, ["0"], alerts="off") as mon:
        mon.pause()
        net(torch.randn(2, 4))
        assert mon.step().layers == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stats": []}, r"^stats: no group chosen"),
        ({"stats": ()}, r"^stats: no group chosen"),
        ({"histograms": -1}, r"^histograms must be an int >= 0"),
        ({"histograms": 2.5}, r"^histograms must be an int >= 0"),
        ({"histograms": True}, r"^histograms must be an int >= 0"),
        ({"keep": 0}, r"^keep must be None or an int >= 1"),
        ({"keep": -3}, r"^keep must be None or an int >= 1"),
        ({"keep": 1.5}, r"^keep must be None or an int >= 1"),
        ({"every": 0}, r"^every must be a positive int"),
        ({"every": True}, r"^every must be a positive int"),
        ({"sentinel": "yes"}, r"^sentinel must be True or False"),
        ({"thresholds": {"nope": 1}}, r"^unknown threshold"),
    ],
)
def test_monitor_arguments_it_cannot_honour_are_refused(kwargs, match):
    """Arguments that would make every record empty or make no sense raise at creation (as an
    empty layer selection does), naming the argument and the valid choices."""
    net = _net()
    with pytest.raises(ValueError, match=match):
        hs.Monitor(net, ["0"], **kwargs)
    assert not net[0]._forward_hooks  # nothing left attached


def test_a_monitor_with_no_stats_group_but_the_sentinel_is_accepted():
    """stats=() with sentinel=True records only where a NaN/Inf starts: a valid choice."""
    net = _net()
    with hs.Monitor(net, stats=(), sentinel=True, alerts="off") as mon:
        net(torch.randn(2, 4)).sum().backward()
        rec = mon.step()
    assert rec is not None and rec.layers == {} and rec.params == {} and rec.nonfinite is None
