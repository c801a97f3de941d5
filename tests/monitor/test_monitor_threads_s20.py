"""Layers the model's forward runs in a worker thread: the Monitor's statistics of them were
missing from every record without a word, and find_nonfinite blamed a NaN made there on the
layer that called them (the root) silently. Both now say which layers ran in which thread."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.threads import Worker

THREAD = "worker of the forward"


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def test_monitor_says_the_layers_a_worker_thread_ran():
    model = Worker(THREAD)
    mon = hs.Monitor(model, every=1)
    with mon:
        said = pytest.warns(hs.MonitorWarning, match=f"'b.0', 'b.1' ran in thread '{THREAD}'")
        with said:
            model(X).sum().backward()
            rec = mon.step()
        model(X).sum().backward()
        mon.step()  # (said once)
    # this thread's layers are recorded as a hand forward gives them
    with torch.no_grad():
        h = model.a(X)
    assert rec.layers["a"]["mean"] == pytest.approx(float(h.mean()), rel=1e-6)
    assert "b.0" not in rec.layers and "b.1" not in rec.layers


def test_find_nonfinite_says_its_origin_may_be_in_a_worker_thread():
    model = Worker(THREAD)
    with torch.no_grad():
        model.b[0].weight[0, 0] = float("nan")
    with pytest.warns(hs.HookscopeWarning, match=f"'b' ran in thread '{THREAD}'.* may be wrong"):
        origin = hs.find_nonfinite(model, X)
    assert origin is not None and origin.layer == ""  # (the caller of the unseen calls)
