"""Audit (round 18) of the core engine: each test failed before its fix, for the reason it names.

References are independent of hookscope: gradients from ``torch.autograd.grad`` of a fresh
forward, values from the plain computation.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Identity(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_captured_gradients_do_not_alias_a_leafs_grad():
    """A gradient reaching a leaf unchanged (the input of a first layer, an Identity on the input)
    was kept as autograd's own buffer, which ``AccumulateGrad`` adopts as ``x.grad``: a later
    ``x.grad.zero_()`` (``optimizer.zero_grad(set_to_none=False)``) or a second backward adding
    into ``x.grad`` in place changed the captured gradients."""
    net = _net()
    x = torch.randn(2, 3, requires_grad=True)
    (ref,) = torch.autograd.grad(net(x).sum(), x)  # d loss / d x: the gradient at "0" and "1"
    with hs.capture(net, ["0", "1"], inputs=True, grads=True) as cap:
        net(x).sum().backward()
    net(x).sum().backward()  # accumulates into x.grad in place
    assert torch.equal(cap.grads["0"], ref)
    assert torch.equal(cap.last("0").input_grad.args[0], ref)
    assert torch.equal(cap.last("1").input_grad.args[0], ref)
    x.grad.zero_()  # what zero_grad(set_to_none=False) does
    assert torch.equal(cap.grads["0"], ref)


def test_tensor_grads_do_not_alias_a_leafs_grad():
    y = torch.randn(3, requires_grad=True)
    with hs.tensor_grads(y) as tg:
        (y * 2).sum().backward()
    y.grad.mul_(0)
    assert torch.equal(tg[0], torch.full((3,), 2.0))


def test_values_recorded_inside_vmap_are_refused_after_it():
    """Under ``torch.func.vmap`` (and jacrev, which vmaps) the hooks see vmap's per-sample
    wrappers: ``cap[name]`` came back as a ``BatchedTensor`` whose shape lacked the batch
    dimension (and ``cap.grads`` under jacrev likewise), silently. Now reading one raises,
    naming the layer; inside the vmapped function the wrappers still work (FeatureExtractor)."""
    net = _net()
    x = torch.randn(5, 3)
    with hs.capture(net, "1", inputs=True) as cap:
        torch.vmap(net)(x)
    with pytest.raises(hs.HookscopeError, match=r"output of '1' \(call 0\).*vmap"):
        cap["1"]
    with pytest.raises(hs.HookscopeError, match=r"inputs of '1'.*vmap"):
        cap.inputs["1"]
    with hs.capture(net, "1", grads=True) as cap:
        torch.func.jacrev(net)(x[0])
    with pytest.raises(hs.HookscopeError, match=r"output gradient of '1'.*vmap"):
        cap.grads["1"]
    # read inside the vmapped function: the batch, exact
    fx = hs.FeatureExtractor(net, ["1"])
    out = torch.vmap(fx)(x)
    assert torch.equal(out["1"], torch.nn.functional.linear(x, net[1].weight, net[1].bias))


def test_values_recorded_inside_grad_transform_are_the_layers_values():
    """``torch.func.grad`` hands hooks gradient-tracking wrappers holding the exact values:
    read after the transform they come back as plain tensors."""
    net = _net()
    x = torch.randn(3)
    with hs.capture(net, "1") as cap:
        torch.func.grad(lambda v: net(v).sum())(x)
    out = cap["1"]
    assert not torch._C._functorch.is_functorch_wrapped_tensor(out)
    assert torch.equal(out, torch.nn.functional.linear(x, net[1].weight, net[1].bias))


class _Broken(nn.Module):
    """A graph break (print) between its first layer and the others."""

    def __init__(self, brk: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.brk = brk

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.brk:
            print("", end="")
        return self.c(self.b(h))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_hooks_after_a_graph_break_of_a_warm_compiled_model_run(fresh_dynamo, form):
    """A compiled model with a graph break, called once without hooks (the usual order: compile,
    run, then look): Dynamo's isolated cache of the hooked variant fell back to the code that
    call compiled for the rest of the forward after the break, which runs no hooks. The layers
    before the break were captured, those after it silently not, and an edit on ``c`` did not
    act (only the edit's 'never ran' warning, blaming the model)."""
    torch.manual_seed(0)
    model = _Broken()
    x = torch.randn(5, 3)
    with torch.no_grad():
        ha = torch.relu(model.a(x))
        hb = model.b(ha)
        ref = {"a": model.a(x), "b": hb, "c": model.c(hb)}
    if form == "wrapper":
        cm = torch.compile(model, backend="eager")
    else:
        cm = model
        cm.compile(backend="eager")
    with torch.no_grad():
        cm(x)  # warm: compiled without hooks
    with (
        pytest.warns(hs.HookscopeWarning, match=r"'a', 'b', 'c'.*graph breaks"),
        torch.no_grad(),
        hs.capture(cm, ["a", "b", "c"]) as cap,
    ):
        cm(x)
    for name, value in ref.items():
        assert torch.equal(cap[name], value), name
    with torch.no_grad(), hs.edit(cm, {"c": hs.ops.zero()}):
        assert torch.equal(cm(x), torch.zeros(5, 2))


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_a_warm_compiled_model_without_graph_breaks_stays_compiled(fresh_dynamo, form):
    model = _Broken(brk=False)
    if form == "wrapper":
        cm = torch.compile(model, backend="eager")
    else:
        cm = model
        cm.compile(backend="eager")
    x = torch.randn(5, 3)
    with torch.no_grad():
        cm(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        with torch.no_grad(), hs.capture(cm, ["b"]) as cap:
            cm(x)
    assert torch.equal(cap["b"], model.b(torch.relu(model.a(x))).detach())


def test_capture_and_edit_of_one_layer_act_in_the_order_they_were_opened():
    """Documented (docs/guide/core.md): opened outside an edit, a capture sees what the layer
    returned; opened inside it, the edited value the model goes on with; two edits compose in
    the order opened. References: the plain computation."""
    net = _net()
    x = torch.randn(2, 3)
    own = torch.nn.functional.linear(x, net[1].weight, net[1].bias).detach()
    with (
        hs.capture(net, "1") as outside,
        hs.edit(net, {"1": hs.ops.add(1.0)}),
        hs.capture(net, "1") as inside,
        hs.edit(net, {"1": hs.ops.scale(3.0)}),
    ):
        out = net(x)
    assert torch.equal(outside["1"], own)
    assert torch.equal(inside["1"], own + 1.0)
    ref = net[3](torch.tanh((own + 1.0) * 3.0))
    assert torch.equal(out, ref)
