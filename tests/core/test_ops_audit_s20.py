"""hs.ops keep the dtype and shape of what they edit, or refuse naming the layer: each case here
was silent before (the value changed dtype or shape, was rounded twice, truncated, or the
replacement tensor was the model's own and changed by its in-place ops). References: the same
arithmetic written by hand, in float32 and rounded once to the value's dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs


class _Idx(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 1, torch.arange(x.shape[0])


class _Net(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor):
        return self.inner(x)


class _PlusOne(nn.Module):
    """A layer whose output the model then changes in place (a residual's `out += x`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y += 1
        return y


@pytest.mark.parametrize("make", [hs.ops.scale, hs.ops.add])
def test_float32_tensor_argument_on_bf16_output_keeps_dtype_rounded_once(make):
    """scale(k) with a float32 k turned a bf16 output into float32 (the next layer got another
    dtype); add(v) rounded v to bf16 before adding (up to 1e-3 off the float32 sum on values ~1).
    Now both give the float32 result rounded once to bf16, bit for bit."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 64).to(torch.bfloat16)
    net, x = _Net(lin), torch.randn(16, 8, dtype=torch.bfloat16)
    k = torch.rand(64) * 3 + 0.1
    with hs.edit(net, {"inner": make(k)}):
        got = net(x)
    out = lin(x)
    ref = (out.float() * k if make is hs.ops.scale else out.float() + k).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref)


def test_gradient_scaled_by_a_float64_tensor_keeps_the_gradient_dtype():
    x = torch.randn(5, requires_grad=True)
    k = torch.full((5,), 1 / 3, dtype=torch.float64)
    with hs.edit_grads(None, {x: hs.ops.scale(k)}):
        (x * 2).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, (torch.full((5,), 2.0, dtype=torch.float64) * k).float())


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (hs.ops.scale(2.5), r"'inner'.*scale\(k=2.5\).*int64"),
        (hs.ops.add(0.5), r"'inner'.*add\(v=0.5\).*int64"),
        (hs.ops.add(torch.full((3,), 0.5)), r"'inner'.*float32"),
        (hs.ops.clip_norm(1.0), r"'inner'.*clip_norm.*int64"),
        (hs.ops.replace(0.5), r"'inner'.*cannot hold 0.5"),
        (hs.ops.replace(torch.full((3,), 1.5)), r"'inner'.*float32.*int64"),
    ],
)
def test_integer_output_is_never_made_float_or_truncated(op, match):
    """scale(2.5) on an argmax output returned float32 2.5x indices; replace(0.5) gave 0s
    (full_like truncates); clip_norm cast its factor (< 1) to int64: all 0."""
    net = _Net(_Idx())
    with pytest.raises(hs.HookscopeError, match=match), hs.edit(net, {"inner": op}):
        net(torch.randn(3, 4))


def test_integer_bounds_of_clamp_on_an_integer_output_are_exact():
    """clamp(min=1.5) on int64 returned float32; an integer is >= 1.5 exactly when >= 2."""
    t = torch.arange(-3, 4)
    assert torch.equal(hs.ops.clamp(min=1.5)(t), t.clamp(min=2))
    assert torch.equal(hs.ops.clamp(min=-0.5, max=2.5)(t), t.clamp(-0, 2))
    with pytest.raises(hs.HookscopeError, match="no integer"):
        hs.ops.clamp(min=0.2, max=0.8)(t)


def test_integer_replacement_of_a_float_output_takes_its_dtype():
    """replace(int tensor) turned a float output into int64."""
    net, x = _Net(nn.Identity()), torch.randn(2, 3)
    with hs.edit(net, {"inner": torch.tensor([1, 2, 3])}):
        got = net(x)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([[1.0, 2, 3]] * 2))


@pytest.mark.parametrize("make", [hs.ops.scale, hs.ops.add])
def test_argument_that_broadcasts_the_value_larger_is_refused(make):
    """A (4, 1, 3) k turned a (2, 3) output into (4, 2, 3)."""
    net = _Net(nn.Identity())
    with (
        pytest.raises(hs.HookscopeError, match=r"'inner'.*\(4, 1, 3\).*\(4, 2, 3\)"),
        hs.edit(net, {"inner": make(torch.ones(4, 1, 3))}),
    ):
        net(torch.randn(2, 3))


def test_replacement_is_not_changed_by_the_models_in_place_ops():
    """The replacement tensor itself was handed to the model: its `y += 1` changed it, so the
    second call read 2 (then 3): the replacement became 3 after two calls."""
    net, r = _PlusOne(), torch.ones(2, 3)
    with hs.edit(net, {"a": r}):
        first, second = net(torch.zeros(2, 3)), net(torch.zeros(2, 3))
    assert torch.equal(r, torch.ones(2, 3))
    assert torch.equal(first, torch.full((2, 3), 2.0)) and torch.equal(second, first)
    with hs.edit(net, {"a": hs.ops.replace(torch.ones(3))}):  # broadcast: a stride-0 view before
        assert torch.equal(net(torch.zeros(2, 3)), torch.full((2, 3), 2.0))


def test_nested_refusal_names_the_items():
    net = _Net(_Pair())
    with (
        pytest.raises(hs.HookscopeError, match=r"1: torch.int64 \(3,\).*lambda out"),
        hs.edit(net, {"inner": hs.ops.scale(2.5)}),
    ):
        net(torch.ones(3, 2))


def test_clip_norm_on_bf16_is_the_float32_result_rounded_once():
    """The factor was rounded to bf16 before the product: the clipped norm exceeded max_norm by
    up to 0.28% (0.065% for the float32 product rounded once)."""
    torch.manual_seed(0)
    g = (torch.randn(4096) * 3).to(torch.bfloat16)
    got = hs.ops.clip_norm(1.0)(g)
    factor = 1.0 / (torch.linalg.vector_norm(g.float()) + 1e-6)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (g.float() * factor).to(torch.bfloat16))


def test_op_repr_names_the_public_function():
    assert repr(hs.ops.clip_norm(2.0)) == "hs.ops.clip_norm(max_norm=2.0)"
    assert repr(hs.ops.scale(torch.ones(3))) == "hs.ops.scale(k=<tensor (3,) float32>)"
