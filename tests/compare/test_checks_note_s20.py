"""hs.compare's check that a compiled run's code did not skip hooks, when the eager run it makes
for that check fails: no verdict, said (a warning and a note), never silent."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class Skips(Net):
    """Calls blocks.0 and the head, not blocks.1; refuses to run without autograd (the check's
    eager run is under no_grad)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this model needs autograd")
        return self.head(torch.relu(self.blocks[0](x)))


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.pow(2).mean()


def test_a_failed_eager_check_of_a_compiled_run_is_said() -> None:
    b = Skips()
    b.load_state_dict(Net().state_dict())
    cb = torch.compile(b, backend="aot_eager")
    # the reference: such an eager run fails
    with (
        pytest.raises(RuntimeError, match="needs autograd"),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        cb(X)
    with pytest.warns(hs.HookscopeWarning, match="could not be checked") as got:
        report = hs.compare(Net(), cb, X, loss_fn=_loss)
    assert len(got) == 1
    msg = str(got[0].message)
    assert "b: 1 module(s) of b ('blocks.1')" in msg and "needs autograd" in msg
    assert "torch._dynamo.reset()" in msg
    assert any("could not be checked" in n and "'blocks.1'" in n for n in report.notes)
    assert "a: blocks.1#0" in report.unmatched  # its rows stay listed as unmatched
    # the paired rows are compared: the same weights, so the head computes the same on the same
    # input (the reference: both heads run by hand); its output differs (blocks.1 did not run)
    ref, h = Net(), torch.relu(b.blocks[0](X))
    assert torch.equal(ref.head(h), b.head(h))
    row = report.row("head")
    assert row.local_error == 0.0 and row.error is not None and row.error > row.tol


def test_an_eager_model_whose_check_fails_says_nothing() -> None:
    """Not compiled: its hooks run whenever their module does, the check has nothing to find."""
    b = Skips()
    b.load_state_dict(Net().state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = hs.compare(Net(), b, X, loss_fn=_loss)
    assert "a: blocks.1#0" in report.unmatched
    assert not any("could not be checked" in n for n in report.notes)


def test_the_check_run_itself_does_not_warn_that_its_hooks_did_not_run() -> None:
    """A compiled B that does not call blocks.1: the check's eager run finds that out (listed as
    unmatched); the compiled region's "none of the hooks ran" warning about the check's own
    counting hooks reached the user (and, with warnings as errors, made the check give up)."""

    class SkipsAlways(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.blocks[0](x)))

    b = SkipsAlways()
    b.load_state_dict(Net().state_dict())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        report = hs.compare(Net(), torch.compile(b, backend="aot_eager"), X, loss_fn=_loss)
    assert [str(w.message)[:80] for w in got] == []
    assert {"a: blocks.1#0"} <= set(report.unmatched)
