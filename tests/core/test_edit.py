"""edit / edit_grads / clip_grads / ops: edited runs equal a hand-edited model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    )


def test_ablate_channels_equals_hand_edited_model():
    net = _cnn()
    x = torch.randn(2, 3, 8, 8)
    with hs.edit(net, {"1": hs.ops.ablate([0, 3])}):
        got = net(x)
    h = F.relu(net[0](x))
    h[:, [0, 3]] = 0
    assert torch.allclose(got, net[4](net[3](net[2](h))))


@pytest.mark.parametrize(
    ("op", "fn"),
    [
        (hs.ops.zero(), lambda h: h * 0),
        (hs.ops.scale(-2.0), lambda h: -2 * h),
        (hs.ops.add(0.5), lambda h: h + 0.5),
        (hs.ops.clamp(min=0.1, max=0.2), lambda h: h.clamp(0.1, 0.2)),
        (hs.ops.replace(1.5), lambda h: torch.full_like(h, 1.5)),
        (
            hs.ops.replace(torch.arange(4.0).view(1, 4, 1, 1)),
            lambda h: torch.arange(4.0).view(1, 4, 1, 1).expand_as(h),
        ),
        (hs.ops.clip_norm(1.0), lambda h: h * min(1.0, 1.0 / (h.norm().item() + 1e-6))),
        (lambda h: h.flip(1), lambda h: h.flip(1)),
    ],
)
def test_each_op_equals_hand_edit(op, fn):
    net = _cnn()
    x = torch.randn(2, 3, 8, 8)
    with hs.edit(net, {"0": op}):
        got = net(x)
    want = net[4](net[3](net[2](F.relu(fn(net[0](x))))))
    assert torch.allclose(got, want, atol=1e-6)


def test_edit_keyword_input_by_name_and_by_position():
    class Attn(nn.Module):
        def forward(self, x, mask=None):
            return x if mask is None else x * mask

    class Net(nn.Module):
        def __init__(self, by_kw):
            super().__init__()
            self.attn, self.by_kw = Attn(), by_kw

        def forward(self, x, mask):
            return self.attn(x, mask=mask) if self.by_kw else self.attn(x, mask)

    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    for by_kw in (True, False):
        net = Net(by_kw)
        with hs.edit(net, {"attn": hs.ops.zero()}, at="input", arg="mask"):
            assert torch.equal(net(x, mask), torch.zeros(2, 3))
        with hs.edit(net, {"attn": hs.ops.scale(3.0)}, at="input"):
            assert torch.allclose(net(x, mask), 3 * x)
    net = Net(True)
    with (
        pytest.raises(hs.HookscopeError, match="no input 'bogus'"),
        hs.edit(net, {"attn": hs.ops.zero()}, at="input", arg="bogus"),
    ):
        net(x, mask)


def test_edit_nested_output_applies_op_to_every_tensor():
    lstm = nn.LSTM(3, 4, batch_first=True)
    with hs.edit(lstm, {"": hs.ops.zero()}):
        out, (h, c) = lstm(torch.randn(2, 5, 3))
    assert out.abs().sum() == 0 and h.abs().sum() == 0 and c.abs().sum() == 0


def test_edit_errors():
    net = _cnn()
    with pytest.raises(ValueError, match="at must be"):
        hs.edit(net, {"0": hs.ops.zero()}, at="outputs")
    with pytest.raises(ValueError, match="does not broadcast"), hs.edit(net, {"0": torch.ones(5)}):
        net(torch.randn(1, 3, 8, 8))
    with (
        pytest.raises(ValueError, match=r"channel\(s\) \[7\] out of range"),
        hs.edit(net, {"0": hs.ops.ablate(7)}),
    ):
        net(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="clamp needs"):
        hs.ops.clamp()
    assert repr(hs.ops.clamp(min=0)) == "hs.ops.clamp(min=0, max=None)"


def test_edit_grads_on_layer_equals_hand_computation_with_inplace_relu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3))
    x = torch.randn(2, 3, 8, 8)
    with hs.edit_grads(net, {"0": hs.ops.scale(-1.0)}):
        net(x).pow(2).sum().backward()
    got = net[0].weight.grad.clone()
    y = net[0](x)
    (gy,) = torch.autograd.grad(net[2](F.relu(y)).pow(2).sum(), y)
    (want,) = torch.autograd.grad(y, net[0].weight, grad_outputs=-gy)
    assert torch.allclose(got, want, atol=1e-5)


def test_edit_grads_parameter_glob():
    net = _cnn()
    x = torch.randn(2, 3, 8, 8)
    with hs.edit_grads(net, {"*.bias": hs.ops.zero()}):
        net(x).sum().backward()
    assert all(p.grad.abs().sum() == 0 for n, p in net.named_parameters() if n.endswith("bias"))
    assert all(p.grad.abs().sum() > 0 for n, p in net.named_parameters() if n.endswith("weight"))


def test_edit_grads_requires_grad_and_model_for_names():
    net = _cnn().requires_grad_(False)
    with pytest.raises(hs.HookscopeError, match="does not require grad"):
        hs.edit_grads(net, {"0.weight": hs.ops.zero()})
    with pytest.raises(ValueError, match="accepts only tensors"):
        hs.edit_grads(None, {"0": hs.ops.zero()})
    assert hs.hooks_on(net) == []


def test_clip_grads_validation_and_param_subset():
    net = _cnn()
    with pytest.raises(ValueError, match="needs value=, max_norm= or both"):
        hs.clip_grads(net)
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        hs.clip_grads(net, value=-1)
    with hs.clip_grads(net, value=1e-4, params="4.*"):
        net(torch.randn(4, 3, 8, 8)).pow(2).sum().backward()
    assert net[4].weight.grad.abs().max() <= 1e-4
    assert net[0].weight.grad.abs().max() > 1e-4


class _Branchy(nn.Module):
    """``skip`` runs only when ``use_skip``; ``head`` is called through ``.forward`` (no hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.skip, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
        self.use_skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.use_skip:
            h = self.skip(h)
        return self.head.forward(h)


@pytest.mark.parametrize("at", ["output", "input"])
def test_an_edit_of_a_layer_that_never_runs_warns_naming_it(at):
    net = _Branchy()
    x = torch.randn(2, 3)
    with (
        pytest.warns(hs.HookscopeWarning, match=r"edit: layer\(s\) 'skip', 'head' never ran"),
        hs.edit(
            net, {"skip": hs.ops.zero(), "head": hs.ops.zero(), "body": hs.ops.scale(1.0)}, at=at
        ),
    ):
        net(x)
    net.use_skip = True
    with hs.edit(net, {"skip": hs.ops.zero()}, at=at):  # it ran: no warning (warnings are errors)
        net(x)
    with pytest.raises(RuntimeError, match="boom"), hs.edit(net, {"head": hs.ops.zero()}):
        raise RuntimeError("boom")  # an exception says more: no warning on top of it


def test_a_gradient_edit_that_never_acts_warns_naming_the_layer_or_parameter():
    net = _Branchy()
    x = torch.randn(2, 3)
    with (
        pytest.warns(hs.HookscopeWarning, match=r"edit_grads: layer\(s\) 'skip' never ran"),
        hs.edit_grads(net, {"skip": hs.ops.zero()}),
    ):
        net(x).sum().backward()
    with (
        pytest.warns(
            hs.HookscopeWarning, match=r"edit_grads: layer\(s\) 'body' never ran .*requires grad"
        ),
        hs.edit_grads(net, {"body": hs.ops.zero()}),
        torch.no_grad(),
    ):
        net(x)
    with (
        pytest.warns(
            hs.HookscopeWarning, match=r"edit_grads: parameter\(s\) 'skip.weight' got no gradient"
        ),
        hs.edit_grads(net, {"skip.weight": hs.ops.zero()}),
    ):
        net(x).sum().backward()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"clip_grads: parameter\(s\) 'skip.weight', 'skip.bias' got no",
        ),
        hs.clip_grads(net, value=1.0, params="skip.*"),
    ):
        net(x).sum().backward()
    with hs.clip_grads(net, value=1.0):  # every parameter, not named: unused ones are fine
        net(x).sum().backward()
    assert hs.hooks_on(net) == []


def test_edit_and_clip_arguments_are_refused_when_the_scope_is_made():
    net = _cnn()
    for bad in (float("nan"), float("inf"), -1.0, 0):
        with pytest.raises(ValueError, match=r"clip_grads: value must be a finite number > 0"):
            hs.clip_grads(net, value=bad)
        with pytest.raises(ValueError, match=r"clip_grads: max_norm must be a finite number > 0"):
            hs.clip_grads(net, max_norm=bad)
    with pytest.raises(TypeError, match="clip_grads: value must be a number > 0; got str"):
        hs.clip_grads(net, value="1")
    with pytest.raises(TypeError, match="clip_grads: params must be a parameter name or glob"):
        hs.clip_grads(net, value=1.0, params=[])
    with pytest.raises(hs.LayerNotFoundError, match="edit: edits is empty"):
        hs.edit(net, {})
    with pytest.raises(hs.LayerNotFoundError, match="edit_grads: edits is empty"):
        hs.edit_grads(net, {})
    with pytest.raises(TypeError, match=r"edit: the edit for '0' must be a hs.ops op, .* got str"):
        hs.edit(net, {"0": "zero"})
    with pytest.raises(TypeError, match="edit: edits must be a dict"):
        hs.edit(net, ["0"])
    assert hs.hooks_on(net) == []


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: hs.ops.clamp(min=float("nan")), "hs.ops.clamp: min must be finite"),
        (lambda: hs.ops.clamp(max="1"), "hs.ops.clamp: max must be a finite number; got str"),
        (lambda: hs.ops.scale("2"), "hs.ops.scale: k must be a finite number or a tensor; got str"),
        (lambda: hs.ops.scale(float("inf")), "hs.ops.scale: k must be finite"),
        (
            lambda: hs.ops.add(None),
            "hs.ops.add: v must be a finite number or a tensor; got NoneType",
        ),
        (lambda: hs.ops.replace("x"), "hs.ops.replace: value must be a number or a tensor"),
        (lambda: hs.ops.clip_norm(float("nan")), "hs.ops.clip_norm: max_norm must be finite"),
        (lambda: hs.ops.ablate("a"), "hs.ops.ablate: channels must be an int or a list of ints"),
        (lambda: hs.ops.ablate(1, dim="1"), "hs.ops.ablate: dim must be an int"),
    ],
)
def test_an_op_with_a_bad_value_is_refused_when_made(make, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(")):
        make()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_capture_to_a_device_this_process_lacks_fails_at_the_call():
    net = _cnn()
    with pytest.raises(ValueError, match="capture: to='cuda': this process has no cuda device"):
        hs.capture(net, "0", to="cuda")
    with pytest.raises(ValueError, match="capture: to='gpu' is not a device"):
        hs.capture(net, "0", to="gpu")
    assert hs.hooks_on(net) == []
