"""Audit of compiled models (s20): a watching scope opened on the module a warm
``torch.compile`` wrapper wraps, while the wrapper is called, saw no calls and said nothing
(observe, trace; the monitor said only that no layer ran). Reference: the same scope on the eager
model (its calls observed, traced, monitored)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.compiled import TwoLayer, fresh_dynamo

_fresh_dynamo = pytest.fixture(autouse=True)(fresh_dynamo)
Net = TwoLayer


X = torch.randn(5, 4)


def warm() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    cm = torch.compile(net, backend="aot_eager")
    cm(X)  # compiled without hooks: the code later calls reuse
    return net, eager, cm


def _observe(model: nn.Module, call: nn.Module) -> int:
    seen: list[str] = []
    with hs.observe(model, ["a", "b"], lambda c: seen.append(c.layer)):
        call(X)
    return len(seen)


def _trace(model: nn.Module, call: nn.Module) -> int:
    with hs.trace(model, file=io.StringIO()) as tr:
        call(X)
    return len(tr.events)


def _monitor(model: nn.Module, call: nn.Module) -> int:
    with hs.Monitor(model, every=1, alerts="off") as mon:
        call(X).sum().backward()
        rec = mon.step()
    return len(rec.to_dict()["layers"])


@pytest.mark.filterwarnings("ignore:Dynamo does not know:UserWarning")
@pytest.mark.filterwarnings(
    "ignore:step 0. no monitored layer ran"
)  # (the monitor's own, no cause)
@pytest.mark.parametrize("watch", [_observe, _trace, _monitor], ids=["observe", "trace", "monitor"])
def test_a_watching_scope_on_the_module_a_warm_compiled_wrapper_wraps_warns(watch):
    net, eager, cm = warm()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        want = watch(eager, eager)  # the eager reference: every layer seen, no warning
    assert want >= 2
    with pytest.warns(
        hs.HookscopeWarning, match="wrapper of it that hookscope was not given"
    ) as rec:
        got = watch(net, cm)
    msg = next(str(w.message) for w in rec if issubclass(w.category, hs.HookscopeWarning))
    assert "'a'" in msg and "Give hookscope the object you call" in msg
    assert got < want  # what it missed (the reason for the warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        assert watch(cm, cm) == want  # given the object called: routed, exact, no warning


def test_the_module_called_itself_after_a_compile_does_not_warn():
    net, eager, _ = warm()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        assert _observe(net, net) == _observe(eager, eager) == 2
