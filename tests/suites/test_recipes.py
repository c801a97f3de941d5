"""Common hook recipes (a non-leaf tensor's gradient, clamped gradients, every layer's activations or
output shape, pre-hooks and output replacement) done through hookscope, with asserted values."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import hookscope as hs


def test_gradient_of_non_leaf_tensor_without_retain_grad():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    b = a * a  # non-leaf
    with hs.tensor_grads(b) as g:
        c = b.mean()
        c.backward()
    assert torch.equal(g[0], torch.full((4,), 0.25))  # d mean(b) / d b
    assert not b.retains_grad  # no retain_grad was needed
    assert torch.equal(a.grad, 2 * a.detach() / 4)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))


def test_clamp_conv_output_grad_and_zero_fc_bias_grad():
    torch.manual_seed(0)
    net = ConvNet()
    x = torch.randn(2, 1, 6, 6)
    target = torch.tensor([0, 2])
    with hs.edit_grads(net, {"conv": hs.ops.clamp(min=0), "fc.bias": hs.ops.zero()}):
        F.cross_entropy(net(x), target).backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters()}

    # by hand: the conv output's gradient clamped at 0, propagated into the conv's parameters
    y = net.conv(x)
    loss = F.cross_entropy(net.fc(torch.flatten(y, 1)), target)
    gy, gw_fc = torch.autograd.grad(loss, [y, net.fc.weight], retain_graph=True)
    gw, gb = torch.autograd.grad(y, [net.conv.weight, net.conv.bias], grad_outputs=gy.clamp(min=0))
    assert (gy < 0).any()  # the clamp matters
    assert torch.allclose(got["conv.weight"], gw, atol=1e-6)
    assert torch.allclose(got["conv.bias"], gb, atol=1e-6)
    assert torch.equal(got["fc.bias"], torch.zeros(3))
    assert torch.allclose(got["fc.weight"], gw_fc)


def test_collect_activations_of_every_non_container_layer():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 3), nn.Tanh()),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
    )
    x = torch.randn(1, 3, 8, 8)
    leaves = hs.find(net, leaves=True)
    assert list(leaves) == ["0", "1", "2.0", "2.1", "3", "4"]
    with hs.capture(net, leaves) as cap:
        net(x)
    h0 = net[0](x)
    h1 = F.relu(h0)
    h20 = net[2][0](h1)
    h21 = torch.tanh(h20)
    h3 = h21.flatten(1)
    expected = {"0": h0, "1": h1, "2.0": h20, "2.1": h21, "3": h3, "4": net[4](h3)}
    assert list(cap) == list(expected)
    for k, v in expected.items():
        assert torch.equal(cap[k], v), k


@pytest.mark.slow
def test_print_every_layer_output_shape_resnet50():
    model = torchvision.models.resnet50(weights=None).eval()
    buf = io.StringIO()
    with torch.no_grad(), hs.trace(model, hs.find(model, leaves=True), file=buf) as tr:
        model(torch.randn(10, 3, 224, 224))
    header, *lines = buf.getvalue().splitlines()
    assert header.split()[:3] == ["layer", "#", "type"]  # a header names the columns
    assert (
        len(lines) == len(tr.events) == 158
    )  # 126 leaf layers; each bottleneck's ReLU runs 3 times
    assert len({e.layer for e in tr.events}) == len(hs.find(model, leaves=True)) == 126
    assert [e.index for e in tr.events if e.layer == "layer1.0.relu"] == [0, 1, 2]
    assert re.match(
        r"\s*conv1\s+0\s+Conv2d\s+[\d.]+\s+float32\s+cpu\s+"
        r"\[10, 3, 224, 224\] -> \[10, 64, 112, 112\]",
        lines[0],
    )
    assert re.match(r"\s*fc\s+0\s+Linear\s+.*\[10, 2048\] -> \[10, 1000\]", lines[-1])
    shapes = {e.layer: e.output_shapes for e in tr.events}
    assert shapes["layer1.0.conv3"] == [10, 256, 56, 56]
    assert shapes["layer4.2.conv3"] == [10, 2048, 7, 7]
    assert shapes["avgpool"] == [10, 2048, 1, 1]


def test_clamp_all_parameter_gradients_of_resnet50():
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    x = torch.randn(2, 3, 64, 64)
    model(x).logsumexp(1).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with hs.clip_grads(model, value=0.01):
        model(x).logsumexp(1).sum().backward()
    clipped = 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n].clamp(-0.01, 0.01)), n
        clipped += int((plain[n].abs() > 0.01).any())
    assert clipped > 10  # the clamp actually bit
    assert hs.hooks_on(model) == []


def test_forward_pre_hook_halving_the_input():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with hs.edit(net, {"2": hs.ops.scale(0.5)}, at="input"):
        got = net(x)
    assert torch.allclose(got, net[2](0.5 * F.relu(net[0](x))))
    assert not torch.allclose(got, net(x))


def test_forward_hook_replacing_the_output():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    repl = torch.randn(5, 4)
    with hs.edit(net, {"1": repl}):
        got = net(x)
    assert torch.allclose(got, net[2](repl))


def test_doubling_a_leaf_tensors_gradient():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    with hs.edit_grads(None, {x: hs.ops.scale(2.0)}):
        (x**2).sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()))
    x.grad = None
    (x**2).sum().backward()  # the scope is closed: plain gradient again
    assert torch.equal(x.grad, 2 * x.detach())
