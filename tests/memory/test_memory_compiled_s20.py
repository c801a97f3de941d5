"""Audit s20: ``hs.memory_profile`` of a model with a compiled part showed the modules inside the
compiled region with ``calls 0`` and ``0 B`` although they ran (the compiled graph runs no hook
of theirs): cells that read as measured. They are now ``None`` (``n/a`` in the table); the rows
outside regions and the region roots keep their values. Reference: the eager profile of the same
weights (its regions' subtree totals)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn as nn

import hookscope as hs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def test_rows_inside_a_compiled_region_are_not_measured_not_zero():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 1)))
    x = torch.randn(2, 4)
    eager = hs.memory_profile(net, x)
    part = copy.deepcopy(net)
    part[1] = torch.compile(part[1], backend="aot_eager")
    prof = hs.memory_profile(part, x)
    assert prof.per_region
    for name in ("1.0", "1.1"):  # inside the region: not measured
        r = prof[name]
        assert r.calls is None and r.saved_bytes is None and r.saved_bytes_total is None
        assert r.param_saved_bytes is None and r.flops is None and not r.shared
    # the region's root and the rows outside it: measured, as the eager profile's subtrees
    for name in ("", "0", "1"):
        assert prof[name].calls == eager[name].calls == 1
        assert prof[name].saved_bytes_total == eager[name].saved_bytes_total
        assert prof[name].flops is None  # not counted in a compiled model
    assert prof.total_saved_bytes == eager.total_saved_bytes
    text = prof.to_text()
    model_line = next(ln for ln in text.splitlines() if ln.startswith("(model)"))
    assert model_line.split()[2] == "1"
    tanh = next(ln for ln in text.splitlines() if ln.split()[:2] == ["0", "Tanh"])
    assert tanh.split()[2:] == ["n/a"] * 5
    assert "0 B" not in " ".join(ln for ln in text.splitlines() if "Tanh" in ln)
    d = prof.to_dict()
    assert [r["calls"] for r in d["rows"]] == [1, 1, 1, None, None]


def test_a_wrapper_profile_has_one_measured_row():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(2, 4)
    eager = hs.memory_profile(net, x)
    prof = hs.memory_profile(torch.compile(copy.deepcopy(net), backend="aot_eager"), x)
    assert prof[""].calls == 1 and prof[""].saved_bytes_total == eager[""].saved_bytes_total
    assert all(r.calls is None and r.saved_bytes_total is None for r in prof.rows[1:])
    assert "n/a" in str(prof)
