"""What you read is what the layer returned (docs/pitfalls.md §28): capture, Call, FeatureExtractor, observe
and the CAM methods give a layer's output and inputs as they were, even when the model changes
those tensors in place afterwards; the zero-copy mode (``clone=False``) says when it cannot."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import RESNET34_RESIDUAL_SITES as RESNET_LAYERS
from helpers.common import Boxing, resnet34_with_fx_features


@pytest.fixture(scope="module")
def resnet34():
    return resnet34_with_fx_features()


def test_capture_resnet34_residual_site_equals_fx(resnet34):
    model, x, ref = resnet34
    with torch.no_grad(), hs.capture(model, RESNET_LAYERS) as cap:
        model(x)
    for n in RESNET_LAYERS:
        assert torch.equal(cap[n], ref[n]), n
    # the zero-copy mode sees the residual sum instead, and says so
    with torch.no_grad(), hs.capture(model, RESNET_LAYERS, clone=False) as cap0:
        model(x)
    with pytest.warns(hs.InPlaceModifiedWarning, match=r"'layer2\.1\.bn2' \(call 0\)"):
        seen = cap0["layer2.1.bn2"]
    assert (seen - ref["layer2.1.bn2"]).abs().max() > 1.0


class Reused(nn.Module):
    """One Linear+Tanh used three times; the loop changes each output in place after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.Tanh()

    def forward(self, x):
        for _ in range(3):
            h = self.act(self.lin(x))
            h += 1.0
            x = h
        return x


def test_every_call_of_a_reused_module_is_exact():
    torch.manual_seed(0)
    net = Reused()
    x = torch.randn(2, 4)
    expect, h = [], x
    with torch.no_grad():
        for _ in range(3):
            a = torch.tanh(net.lin(h))
            expect.append(a)
            h = a + 1.0
        with hs.capture(net, "act", inputs=True) as cap:
            net(x)
    calls = cap.calls("act")
    assert len(calls) == 3
    for c, e in zip(calls, expect):
        assert torch.equal(c.output, e)
    assert torch.equal(calls[1].inputs.args[0], net.lin(expect[0] + 1.0))


def test_inputs_are_what_the_layer_received_even_when_it_changes_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True))
    x = torch.randn(4, 3)
    with torch.no_grad():
        pre = net[0](x)
        assert (pre < 0).any()
        with hs.capture(net, "1", inputs=True) as cap:
            net(x)
    assert torch.equal(cap.inputs["1"].args[0], pre)
    assert torch.equal(cap["1"], pre.clamp(min=0))
    with torch.no_grad(), hs.capture(net, "1", inputs=True, clone=False) as cap0:
        net(x)
    with pytest.warns(hs.InPlaceModifiedWarning, match="inputs of '1'"):
        got = cap0.inputs["1"].args[0]
    assert torch.equal(got, pre.clamp(min=0))


def test_zero_copy_reads_without_a_change_do_not_warn_and_share_memory():
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    x = torch.randn(4, 3)
    kept = []
    h = net[0].register_forward_hook(lambda m, i, o: kept.append(o))
    try:
        with torch.no_grad(), hs.capture(net, ["0", "1"], clone=False) as cap:
            net(x)
    finally:
        h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cap["0"].data_ptr() == kept[0].data_ptr()
    with torch.no_grad(), hs.capture(net, ["0", "1"]) as cap1:
        net(x)
    assert cap1["0"].data_ptr() != cap1["1"].data_ptr() and torch.equal(cap1["0"], cap["0"])


def test_observe_inputs_are_exact_and_a_kept_output_warns_once_changed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 1))
    x = torch.randn(4, 3)
    calls = []
    with torch.no_grad():
        pre = net[0](x)
        with hs.observe(net, ["0", "1"], calls.append):
            net(x)
    first, relu = calls
    assert torch.equal(relu.inputs.args[0], pre)  # what ReLU received, before it changed it
    assert torch.equal(relu.output, pre.clamp(min=0))
    with pytest.warns(hs.InPlaceModifiedWarning, match="output of '0'"):
        _ = first.output  # the read warns: the ReLU changed it after the call


class Residual(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        h = self.bn(self.conv(x))
        if self.inplace:
            h += x
        else:
            h = h + x
        return self.conv2(h).mean((2, 3))


def test_multi_layer_cam_reads_activations_as_returned():
    torch.manual_seed(0)
    a, b = Residual(True).eval(), Residual(False).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 8, 8)
    got = hs.EigenCAM(a, ["bn", "conv2"])(x)
    ref = hs.EigenCAM(b, ["bn", "conv2"])(x)
    torch.testing.assert_close(got, ref)
    single = hs.EigenCAM(b, ["bn"])(x)
    assert not torch.allclose(single, ref)  # both layers count: the test is not vacuous


class _Emptying(nn.Module):
    """Reads ``enc``'s box, then empties it (``box.h = zeros``) and scales the tensor it held
    in place."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.out = Boxing(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box = self.enc(x)
        h = box.h
        y = self.out(h)
        box.h = torch.zeros_like(h)
        with torch.no_grad():
            h.mul_(2)
        return y


def test_an_object_a_layer_returns_is_captured_as_it_was_when_the_layer_returned():
    """A layer returning ``Box(h)``: the capture kept the model's own object, which the model
    emptied afterwards, and read zeros. Objects among a value are copied (their tensors kept as
    the others: cloned, or in zero-copy mode the model's own, version-checked)."""
    torch.manual_seed(0)
    m, x = _Emptying(), torch.randn(2, 4)
    with torch.no_grad():
        want = m.enc.lin(x)
    with hs.capture(m, ["enc"]) as cap:
        m(x)
    assert torch.equal(cap["enc"].h, want)
    with hs.capture(m, ["enc"], clone=False) as cap:
        m(x)
    with pytest.warns(hs.InPlaceModifiedWarning):
        got = cap["enc"].h  # the model's own tensor, changed in place since: said
    assert torch.equal(got, want * 2)


def test_output_gradients_leave_the_step_bit_for_bit_and_input_gradients_as_pytorch_s_hooks_do():
    """Output gradients (grads=True) leave the model's .grad bit for bit a plain step's; input
    gradients (inputs=True too) come through identity views, as PyTorch's own
    register_full_backward_hook does, and both leave a .grad equal to a plain step's up to its
    last bits (a norm reading the residual stream twice: its gradient summed in another order)."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = nn.RMSNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(self.norm(x))

    net = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 3))
    x = torch.randn(4, 5, 8)
    names = [n for n, _ in net.named_modules() if n]

    def step() -> dict[str, torch.Tensor]:
        net(x).logsumexp(-1).mean().backward()
        out = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        return out

    plain = step()
    with hs.capture(net, names, grads=True):
        outputs_only = step()
    assert all(torch.equal(outputs_only[n], plain[n]) for n in plain)
    handles = [net.get_submodule(n).register_full_backward_hook(lambda *a: None) for n in names]
    try:
        with warnings.catch_warnings():  # (the first layer's input needs no gradient)
            warnings.simplefilter("ignore", UserWarning)
            pytorch_hooks = step()
    finally:
        for h in handles:
            h.remove()
    with hs.capture(net, names, grads=True, inputs=True):
        with_inputs = step()
    for n in plain:
        torch.testing.assert_close(with_inputs[n], plain[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(pytorch_hooks[n], plain[n], rtol=1e-5, atol=1e-7)
    assert sum(not torch.equal(pytorch_hooks[n], plain[n]) for n in plain) > 0
