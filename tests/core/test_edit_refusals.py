"""edit / edit_grads / clip_grads refuse what they cannot do exactly: an edit that changes a value's
shape or dtype raises naming the layer; a gradient edit or clip whose backward ran after its scope
closed (so it never acted) warns at exit instead of leaving the gradients unedited in silence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _plain_grads(x: torch.Tensor) -> list[torch.Tensor]:
    """The reference: the same model and step without any scope."""
    net = _net()
    net(x).sum().backward()
    return [p.grad for p in net.parameters()]


def test_edit_returning_another_shape_is_refused_naming_the_layer():
    """An edit of the last layer that drops the batch (out[:1]) would silently turn the (3, 2)
    output into (1, 2)."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.HookscopeError, match=r"'2'.*shape \(1, 2\).*shape \(3, 2\)"),
        hs.edit(net, {"2": lambda out: out[:1]}),
    ):
        net(x)


def test_edit_returning_another_dtype_is_refused_naming_the_layer():
    """out.double() would fail in the next layer with PyTorch's dtype message naming no layer."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.HookscopeError, match=r"'0'.*torch\.float64.*torch\.float32"),
        hs.edit(net, {"0": lambda out: out.double()}),
    ):
        net(x)


def test_edit_of_an_input_returning_another_shape_is_refused_naming_the_layer():
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.HookscopeError, match=r"input 0 of '2'.*shape \(3, 4\)"),
        hs.edit(net, {"2": lambda h: h[:, :4]}, at="input"),
    ):
        net(x)


def test_edit_grads_returning_another_shape_names_the_layer():
    """PyTorch's own check says "hook '<unknown>' has changed the size of value"."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.HookscopeError, match=r"gradient of '0'.*shape \(1, 8\).*shape \(3, 8\)"),
        hs.edit_grads(net, {"0": lambda g: g[:1]}),
    ):
        net(x).sum().backward()


def test_edit_keeping_shape_and_dtype_still_acts():
    net, x = _net(), torch.randn(3, 4)
    with hs.edit(net, {"2": lambda out: out * 0 + 1}):
        assert torch.equal(net(x), torch.ones(3, 2))


def test_edit_grads_on_a_layer_whose_backward_runs_after_the_scope_warns():
    """A layer key whose output gradient arrives after the block: the edit never acts (the
    gradients equal an unedited step's), and exit says so, as a parameter key does."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit_grads: the output of layer\(s\) '2' got no gradient while the scope was open",
        ),
        hs.edit_grads(net, {"2": lambda g: g * 0}),
    ):
        out = net(x)
    out.sum().backward()
    for got, want in zip([p.grad for p in net.parameters()], _plain_grads(x)):
        torch.testing.assert_close(got, want)


def test_edit_grads_on_a_layer_with_backward_inside_does_not_warn():
    net, x = _net(), torch.randn(3, 4)
    with hs.edit_grads(net, {"2": lambda g: g * 0}):
        net(x).sum().backward()
    assert net[0].weight.grad.abs().max().item() == 0.0


def test_clip_grads_with_backward_after_the_block_warns():
    """Backward after the block: nothing is clipped (gradients equal an unclipped step's, above
    value), and exit says so."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match="clip_grads: no parameter got a gradient while the scope was open",
        ),
        hs.clip_grads(net, value=1e-3),
    ):
        out = net(x)
    out.sum().backward()
    for got, want in zip([p.grad for p in net.parameters()], _plain_grads(x)):
        torch.testing.assert_close(got, want)
    assert net[2].weight.grad.abs().max().item() > 1e-3


def test_clip_grads_without_backward_or_on_a_frozen_model_warns():
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.warns(hs.HookscopeWarning, match="no parameter got a gradient"),
        hs.clip_grads(net, value=1e-3),
    ):
        net(x)
    net.requires_grad_(False)
    with (
        pytest.warns(hs.HookscopeWarning, match="no parameter of the model requires grad"),
        hs.clip_grads(net, max_norm=1.0),
    ):
        net(x)


def test_clip_grads_with_backward_inside_does_not_warn():
    net, x = _net(), torch.randn(3, 4)
    with hs.clip_grads(net, value=1e-3):
        net(x).sum().backward()
    want = [g.clamp(-1e-3, 1e-3) for g in _plain_grads(x)]
    for got, w in zip([p.grad for p in net.parameters()], want):
        torch.testing.assert_close(got, w)


def test_edit_of_a_tuple_output_changing_a_tensor_shape_is_refused_naming_the_item():
    """An LSTM returns (out, (h, c)); an edit that drops the batch of out would give the next
    layer a value of another shape."""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3, batch_first=True)
    x = torch.randn(2, 5, 4)
    with (
        pytest.raises(hs.HookscopeError, match=r"output of ''.*\(item 0\).*shape \(1, 5, 3\)"),
        hs.edit(lstm, {"": lambda o: (o[0][:1], o[1])}),
    ):
        lstm(x)
    with hs.edit(lstm, {"": lambda o: (o[0] * 0, o[1])}):  # same shapes: acts
        out, (h, _) = lstm(x)
    assert torch.equal(out, torch.zeros(2, 5, 3)) and torch.equal(h, lstm(x)[1][0])


@pytest.mark.parametrize("arg", [1.0, True, -1, b"x", None.__class__])
def test_edit_arg_that_is_not_an_index_or_a_name_is_refused_in_one_line(arg):
    """``arg=1.0`` used to reach a list index (a raw TypeError inside the hook) and ``arg=True``
    was read as input 1: only an int >= 0 or a parameter name selects an input."""
    net = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"^edit: arg= must be a positional index") as e:
        hs.edit(net, {"0": hs.ops.zero()}, at="input", arg=arg)
    assert "\n" not in str(e.value)
    assert hs.hooks_on(net) == []
