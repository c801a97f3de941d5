"""A layer the model's forward runs in a worker thread: summary printed it as "never called
through __call__ (counted in their parent)", yet its FLOPs, time and memory were counted nowhere
(the forward FLOPs 144 where the model computes 240: the FLOP counter is per thread). Now a
warning names the layers and the thread, and says the totals are short by them; the rows of
this thread's layers are unchanged (FlopCounterMode's count of each)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import hookscope as hs
from helpers.threads import Worker

THREAD = "worker of the forward"


def test_summary_says_the_layers_a_worker_thread_ran():
    model, x = Worker(THREAD), torch.randn(3, 4)
    with pytest.warns(
        hs.HookscopeWarning, match=f"'b' ran in thread '{THREAD}'.* totals are short"
    ):
        s = hs.summary(model, x)
    assert "b" not in s.never_called and "b.0" not in s.never_called
    for name in ("a", "c"):
        with FlopCounterMode(display=False) as fc:
            getattr(model, name)(torch.randn(3, 4))
        assert next(r for r in s.rows if r.name == name).flops == fc.get_total_flops()
