"""Audit s20: hookscope's hooks on a model that a warm ``torch.compile`` wrapper hookscope was
not given (``cm = torch.compile(net)``, the scopes opened on ``net``, ``cm`` called) were traced
by Dynamo when it recompiled the wrapper's code (a new input shape): ``hs.trace`` raised
``InternalTorchDynamoError: Unknown format code 'd' for object of type 'str'`` (Dynamo had made
the call index symbolic inside trace's f-string), and every hook's code graph-broke at
``get_ident``. The hooks are now opaque to Dynamo: the calls they see are exact (reference: the
same modules run eagerly on the same inputs, by hand), and the existing warning says that the
wrapper's code skips them elsewhere."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import hookscope as hs
from helpers.compiled import TwoLayer, fresh_dynamo

_fresh_dynamo = pytest.fixture(autouse=True)(fresh_dynamo)
Net = TwoLayer


def test_trace_and_observe_under_a_warm_wrapper_recompiling_are_exact_or_warned():
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    cm = torch.compile(net, backend="aot_eager")
    x2, x3 = torch.randn(2, 4), torch.randn(3, 4)
    cm(x2)  # compiled without hooks
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    buf = io.StringIO()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with (
            hs.trace(net, file=buf) as tr,
            hs.observe(net, "a", lambda c: seen.append((c.inputs.args[0], c.output.clone()))),
        ):
            outs = [cm(x2), cm(x2), cm(x3)]  # the new shape recompiles the wrapper's code
    # the model's values are untouched
    for x, out in zip((x2, x2, x3), outs):
        torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    # each call observed is exact: its input and output equal the eager module's
    assert seen
    for inp, out in seen:
        torch.testing.assert_close(out, eager.a(inp), rtol=1e-6, atol=1e-6)
    for ev in tr.events:
        assert ev.input_shapes in ([2, 4], [3, 4], [2, 6], [3, 6])
    assert buf.getvalue().startswith("layer")
    # Dynamo did not trace hookscope's code (it graph-broke inside it: get_ident, perf_counter)
    texts = [str(w.message) for w in got]
    assert not [t for t in texts if "Dynamo does not know how to trace" in t], texts
    # the calls the wrapper ran from code compiled without the hooks: said, for each scope
    unrouted = [t for t in texts if "torch.compile wrapper of it that hookscope was not given" in t]
    assert any(t.startswith("trace:") for t in unrouted)
    assert any(t.startswith("observe:") for t in unrouted)


def test_hooks_of_a_scope_opened_before_the_first_compiled_call_are_exact():
    """Cold: the wrapper's code is compiled while the hooks are on; the hooks still run eagerly
    (opaque), the values equal a plain hook's on the eager model."""
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    cm = torch.compile(net, backend="aot_eager")
    xs = [torch.randn(2, 4), torch.randn(3, 4), torch.randn(5, 4)]
    want: list[torch.Tensor] = []
    handle = eager.a.register_forward_hook(lambda m, a, o: want.append(o.detach().clone()))
    try:
        for x in xs:
            eager(x)
    finally:
        handle.remove()
    seen: list[torch.Tensor] = []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with hs.observe(net, "a", lambda c: seen.append(c.output.clone())):
            for x in xs:
                cm(x)
    assert len(seen) == len(want)
    for s, w in zip(seen, want):
        torch.testing.assert_close(s, w, rtol=1e-6, atol=1e-6)
    texts = [str(w.message) for w in got]
    assert not [t for t in texts if "Dynamo does not know how to trace" in t], texts
