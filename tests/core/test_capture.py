"""capture(): calls in order, stop early, detach/clone/to, keep, inputs, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import KeepsItsInput, plain_step


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 1


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), Counting())


def test_stop_ends_the_forward_after_the_last_layer():
    net = _net()
    x = torch.randn(2, 3)
    with hs.capture(net, ["0", "2"], stop=True) as cap:
        out = net(x)
        pytest.fail("unreachable: the forward pass stops inside net(x)")
    assert net[3].calls == 0
    assert torch.allclose(cap["2"], net[2](torch.relu(net[0](x))))
    assert "out" not in locals()
    assert hs.hooks_on(net) == []


def test_stop_with_a_layer_that_never_runs():
    net = _net()
    with (
        pytest.raises(hs.LayerNotRunError, match=r"'3'.*never ran"),
        hs.capture(net, ["3"], stop=True),
    ):
        net[:3](torch.randn(1, 3))  # runs only layers 0-2


def test_unknown_and_unrun_layer_errors():
    net = _net()
    with hs.capture(net, ["0", "3"]) as cap:
        net[:2](torch.randn(1, 3))
    with pytest.raises(
        hs.LayerNotFoundError, match="not a captured layer; the captured layers are '0', '3'"
    ):
        cap["1"]
    with pytest.raises(hs.LayerNotRunError, match="never called"):
        cap["3"]
    assert cap.missing == ["3"] and dict(cap).keys() == {"0"}


def test_detach_false_keeps_graph_and_clone_copies():
    net = _net()
    x = torch.randn(2, 3, requires_grad=True)
    with hs.capture(net, "0", detach=False) as cap:
        net(x)
    cap["0"].sum().backward()
    assert torch.allclose(x.grad, net[0].weight.sum(0).expand(2, 3))
    with hs.capture(net, "0", clone=True) as cap2:
        out = net[0](x)
    assert cap2["0"].data_ptr() != out.data_ptr() and cap2["0"].grad_fn is None


def test_keep_last_and_clear():
    net = _net()
    with hs.capture(net, "0", keep="last") as cap:
        for i in range(5):
            net(torch.full((1, 3), float(i)))
    assert len(cap.calls("0")) == 1 and cap.last("0").index == 4
    cap.clear()
    assert list(cap) == []
    with pytest.raises(ValueError, match="keep must be"):
        hs.capture(net, "0", keep="first")


def test_to_moves_captured_tensors():
    net = _net()
    with hs.capture(net, "0", to="meta") as cap:
        net(torch.randn(2, 3))
    assert cap["0"].device.type == "meta" and cap["0"].shape == (2, 3)


def test_inputs_positional_and_keyword_with_input_grads():
    class Mix(nn.Module):
        def forward(self, a, b=None, *, scale=1.0):
            return (a * b).sum() * scale

    m = Mix()
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with hs.capture(m, "", inputs=True, grads=True) as cap:
        m(a, b=b, scale=2.0).backward()
    inp = cap.inputs[""]
    assert (
        torch.equal(inp.args[0], a)
        and torch.equal(inp.kwargs["b"], b)
        and inp.kwargs["scale"] == 2.0
    )
    g = cap.last("").input_grad
    assert torch.allclose(g.args[0], 2 * b.detach()) and torch.allclose(
        g.kwargs["b"], 2 * a.detach()
    )
    assert g.kwargs["scale"] is None
    assert torch.equal(cap.grads[""], torch.tensor(1.0))


def test_input_grads_through_this_layer_only():
    # x feeds both the layer and a residual: the layer's input gradient excludes the residual path
    lin = nn.Linear(3, 3, bias=False)
    x = torch.randn(2, 3, requires_grad=True)
    with hs.capture(lin, "", inputs=True, grads=True) as cap:
        (lin(x) + x).sum().backward()
    assert torch.allclose(cap.last("").input_grad.args[0], lin.weight.sum(0).expand(2, 3))
    assert torch.allclose(x.grad, lin.weight.sum(0).expand(2, 3) + 1)


def test_grads_accumulate_over_two_backward_passes():
    net = _net()
    x = torch.randn(2, 3)
    with hs.capture(net, "2", grads=True) as cap:
        out = net(x)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    assert torch.equal(cap.grads["2"], torch.full((2, 3), 2.0))


def test_repr_and_mapping_protocol():
    net = _net()
    with hs.capture(net, ["0", "2"]) as cap:
        net(torch.randn(1, 3))
        assert "active" in repr(cap)
    assert "closed" in repr(cap) and len(cap) == 2 and set(cap) == {"0", "2"}
    assert repr(cap.last("0")) == "Call('0', index=0, output=(1, 3))"


def test_capture_stop_skips_the_rest_of_the_block_and_says_so():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    out, after = None, []
    with hs.capture(net, "0", stop=True) as cap:
        out = net(x)
        after.append("ran")
    assert cap.stopped and out is None and after == []  # what the docs now say
    assert torch.equal(cap["0"], net[0](x))
    with hs.capture(net, "0") as cap2:  # no stop: the block runs to its end
        out = net(x)
    assert not cap2.stopped and torch.equal(out, net(x))
    with hs.capture(net, "2", stop=True) as cap3:  # the last layer: nothing left to skip
        net(x)
    assert cap3.stopped
    # the form that returns normally, named in capture's docstring
    feats = hs.FeatureExtractor(net, ["0"])(x)
    assert torch.equal(feats["0"], net[0](x))
    assert "cap.stopped" in hs.capture.__doc__ and "FeatureExtractor" in hs.capture.__doc__


def test_a_layer_working_in_place_on_its_input_leaves_the_run_exact_and_says_its_gradient_is_lost():
    """nn.ReLU(inplace=True) changes its input in place. The run under capture is the run without
    it: the same output and parameter gradients, also where the caller keeps the tensor from
    before the ReLU (an alias in place of the view would give that residual a wrong gradient).
    PyTorch drops the gradient hook of a view changed in place: input_grad says so (it used to
    say the layer does not contribute to the loss); the output gradients are exact."""
    torch.manual_seed(0)
    m = KeepsItsInput()
    x = torch.randn(3, 4)
    out_ref, ref = plain_step(m, x)
    with hs.capture(m, ["lin", "act"], inputs=True, grads=True) as cap:
        out = m(x)
        out.pow(2).sum().backward()
    assert torch.equal(out, out_ref)
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    with pytest.raises(hs.NoGradientError, match="changed its input in place"):
        cap.calls("act")[0].input_grad
    m.zero_grad(set_to_none=True)
    h = m.lin(x)
    h.retain_grad()
    y = torch.relu(h)
    y.retain_grad()
    m.out(y * 2 + h * 0 + torch.relu(h) * 3).pow(2).sum().backward()  # skip is relu'd too
    assert torch.allclose(cap.calls("act")[0].grad, y.grad, rtol=1e-6, atol=1e-7)


def test_no_input_gradient_where_no_input_needs_one_says_why():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with hs.capture(m, ["0"], inputs=True, grads=True) as cap:
        m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(hs.NoGradientError, match="none of its inputs requires grad"):
        cap.calls("0")[0].input_grad


def test_an_early_stop_is_not_caught_by_the_model_s_own_except_exception():
    """A forward with a fallback (``try: fast path / except Exception: slow path``) caught the
    early stop as an error and ran its slow path on: the capture then held the fallback's value
    (2 calls) and FeatureExtractor returned it, silently. The stop is a BaseException now: the
    value is a plain hook's, the fallback never runs."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.fallbacks = nn.Linear(4, 4), nn.Linear(4, 4), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                h = self.a(x)
            except Exception:
                self.fallbacks += 1
                h = self.a(x * 0)
            return self.b(h)

    m, x = Net().eval(), torch.randn(2, 4)
    ref = m.a(x)
    with hs.capture(m, "a", stop=True) as cap:
        m(x)
    assert len(cap.calls("a")) == 1 and torch.equal(cap["a"], ref)
    assert torch.equal(hs.FeatureExtractor(m, ["a"])(x)["a"], ref)
    assert m.fallbacks == 0
