"""NaN/Inf origin on hand-built models: find_nonfinite and the monitor's sentinel mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs

INPUT, LOSS = hs.NonFiniteOrigin.INPUT, hs.NonFiniteOrigin.LOSS


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


class Mask(nn.Module):
    """Fills the first column with -inf on purpose (an attention-style mask)."""

    def __init__(self, cols: int = 1) -> None:
        super().__init__()
        self.cols = cols

    def forward(self, x):
        m = torch.zeros_like(x, dtype=torch.bool)
        m[..., : self.cols] = True
        return x.masked_fill(m, float("-inf"))


def fixed(layer: nn.Linear, w: torch.Tensor, b: float = 0.0) -> nn.Linear:
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.fill_(b)
    return layer


def log_net() -> nn.Sequential:
    """Layer 3 takes the log of the negative values made by layer 2."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 3),
        nn.ReLU(),
        fixed(nn.Linear(3, 3), -torch.eye(3), -1.0),
        Log(),
        nn.Linear(3, 1),
    )


def sqrt_net() -> nn.Sequential:
    """Layer 2 takes sqrt at exactly 0: finite forward, infinite gradient in backward."""
    torch.manual_seed(0)
    return nn.Sequential(
        fixed(nn.Linear(3, 3), -torch.ones(3, 3)), nn.ReLU(), Sqrt(), nn.Linear(3, 1)
    )


def test_forward_log_of_negative_is_found_at_its_layer():
    x = torch.rand(4, 3)
    o = hs.find_nonfinite(log_net(), x)
    assert (o.layer, o.phase, o.call, o.kind, o.module_type) == ("3", "forward", 0, "nan", "Log")
    h = log_net()[:3](x)
    assert o.stats["output_nan"] == float(torch.log(h).isnan().sum()) == 12
    assert o.stats["input_absmax"] == pytest.approx(h.abs().max().item())
    assert "layer '3' (Log) call 0" in str(o)


def test_backward_only_sqrt_at_zero():
    net = sqrt_net()
    x = torch.rand(4, 3)
    assert torch.isfinite(net(x)).all()  # the forward pass is clean
    o = hs.find_nonfinite(net, x)
    assert (o.layer, o.phase, o.kind, o.module_type) == ("2", "backward", "inf", "Sqrt")
    assert o.stats["grad_input_inf"] == 12
    assert all(p.grad is None for p in net.parameters())  # find_nonfinite does not touch .grad


def test_nan_entering_with_the_input_is_reported_as_the_input():
    x = torch.rand(4, 3)
    x[1, 2] = float("nan")
    o = hs.find_nonfinite(sqrt_net(), x)
    assert (o.layer, o.phase, o.kind) == (INPUT, "forward", "nan")


def test_intended_inf_mask_on_the_allow_list_gives_no_alert():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Mask(), nn.Softmax(-1), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    o = hs.find_nonfinite(net, x)
    assert (o.layer, o.kind) == ("1", "inf")  # not allowed: reported
    assert hs.find_nonfinite(net, x, allow=[Mask]) is None
    assert hs.find_nonfinite(net, x, allow="1") is None
    # a fully masked row makes softmax NaN: still reported, at the softmax
    net[1].cols = 4
    o = hs.find_nonfinite(net, x, allow=[Mask])
    assert (o.layer, o.phase, o.kind) == ("2", "forward", "nan")


def test_functional_op_in_a_parent_is_blamed_on_the_parent():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(torch.log(self.a(x) - 10.0))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), Block())
    o = hs.find_nonfinite(net, torch.rand(3, 2))
    assert (o.layer, o.phase, o.module_type) == ("1", "forward", "Block")


def test_second_call_of_a_reused_module():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.log = Log()

        def forward(self, x):
            return self.log(self.log(x + 2.0))  # log(log(x+2)) fine; log(log(x+0.5)) may be NaN

    o = hs.find_nonfinite(Net(), torch.full((2,), -1.2))
    assert (o.layer, o.call, o.kind) == ("log", 1, "nan")


def test_nonfinite_loss_and_clean_model():
    net = sqrt_net()
    o = hs.find_nonfinite(net, torch.rand(2, 3), loss_fn=lambda out: out.sum() / 0.0)
    assert (o.layer, o.phase) == (LOSS, "forward")
    clean = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    assert hs.find_nonfinite(clean, torch.rand(2, 3)) is None
    assert hs.find_nonfinite(sqrt_net(), torch.rand(2, 3), backward=False) is None


def train_step(net, x, mon):
    net(x).sum().backward()
    rec = mon.step()
    net.zero_grad()
    return rec


def test_sentinel_reports_each_origin_and_warns():
    x = torch.rand(4, 3)
    cases = [(log_net(), x, ("3", "forward")), (sqrt_net(), x, ("2", "backward"))]
    xn = x.clone()
    xn[0, 0] = float("nan")
    cases.append((sqrt_net(), xn, (INPUT, "forward")))
    for net, inp, (layer, phase) in cases:
        with hs.Monitor(net, every=100, stats=(), sentinel=True) as mon:
            with pytest.warns(hs.NonFiniteWarning, match=str(layer)):
                rec = train_step(net, inp, mon)
            assert (rec.nonfinite.layer, rec.nonfinite.phase) == (layer, phase)
            assert (mon.nonfinite.layer, mon.nonfinite.phase) == (layer, phase)
        assert all(not hs.hooks_on(m) for m in net.modules())


def test_sentinel_allow_list_and_first_layer_parameter_fallback():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Mask(), nn.Softmax(-1), nn.Linear(4, 1))
    with hs.Monitor(net, sentinel=True, allow=[Mask], alerts="warn") as mon:
        rec = train_step(net, torch.randn(3, 4), mon)  # no warning: filterwarnings=error
    assert rec.nonfinite is None and mon.nonfinite is None

    class Scaled(nn.Module):  # sqrt(w * x) with w = 0: infinite gradient for w only
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return torch.sqrt(self.w * x)

    net = nn.Sequential(Scaled(), nn.Linear(3, 1))
    with hs.Monitor(net, sentinel=True, stats=(), alerts="log") as mon:
        rec = train_step(net, torch.rand(2, 3), mon)  # x does not require grad
    assert (rec.nonfinite.layer, rec.nonfinite.phase) == ("0", "backward")
    assert rec.nonfinite.stats["param_grad_absmax"] == float("inf")


def test_find_nonfinite_leaves_batchnorm_statistics_as_found():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), Sqrt())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    o = hs.find_nonfinite(net, torch.randn(6, 3))
    assert o is not None and o.layer == "2"  # sqrt of negative normalised values
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.training


def test_a_tuple_output_value_is_not_taken_for_its_first_tensor():
    """A layer returning (values, mask) with an allowed -inf in the mask, then a layer that makes
    its own inf from the finite values: the second is the origin. (Remembering the tuple's
    max |x| for its first tensor made that input look infinite already, hiding the origin.)"""

    class Split(nn.Module):
        def forward(self, x):
            return x, torch.full_like(x, float("-inf"))

    class Overflow(nn.Module):
        def forward(self, x):
            return x * 1e38 * 1e38

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.split, self.over = Split(), Overflow()

        def forward(self, x):
            v, mask = self.split(x)
            return self.over(v) + mask.clamp_min(0)

    x = torch.rand(2, 3) + 0.5
    o = hs.find_nonfinite(Net(), x, allow=["split"])
    assert (o.layer, o.phase, o.kind) == ("over", "forward", "inf")
    assert o.stats["input_absmax"] == pytest.approx(float(x.abs().max()))


def test_each_tensor_is_reduced_once_per_version(monkeypatch):
    """A parent returning its child's output, and the model's input seen by every first child,
    are reduced once; an in-place change (a new version) is reduced again."""
    from hookscope.monitor import _nonfinite

    seen: list[tuple[torch.Tensor, int]] = []  # the tensors held: no id is reused meanwhile
    real = _nonfinite.minmax

    def counting(t: torch.Tensor) -> torch.Tensor:
        seen.append((t, t._version))
        return real(t)

    monkeypatch.setattr(_nonfinite, "minmax", counting)
    torch.manual_seed(0)
    a, b = nn.Linear(3, 4), nn.Linear(4, 2)
    net = nn.Sequential(nn.Sequential(nn.Sequential(a, nn.ReLU(inplace=True))), b)
    outs: list[torch.Tensor] = []
    x = torch.randn(5, 3)
    with hs.HookScope() as s:  # registered first: they run before find_nonfinite's
        for m in (a, b):
            s.add_forward(m, lambda m, i, o: outs.append(o), layer="")
        assert hs.find_nonfinite(net, x) is None
    keys = [(id(t), v) for t, v in seen]
    assert len(set(keys)) == len(keys)  # never the same tensor at the same version twice
    h, y = outs
    assert [v for t, v in seen if t is h] == [0]
    # the in-place ReLU's result (a view of h: find_nonfinite puts views in front of inputs)
    assert [v for t, v in seen if t is not h and t.data_ptr() == h.data_ptr()] == [1]
    assert sum(t is y for t, _ in seen) == 1  # b's output, though three parents return it
    assert sum(t.shape == x.shape and torch.equal(t, x) for t, _ in seen) == 1


def test_find_nonfinite_leaves_a_layer_s_python_state_as_found():
    """Its forward (and backward) run leaves a layer's call counter, list and tensor attribute
    as found."""
    from helpers.common import Counting

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), Counting(3), Log())
    assert hs.find_nonfinite(net, torch.rand(4, 3) - 2.0).layer is not None
    assert net[1].state() == (False, 0, [], 0.0)


class _Spectrum(nn.Module):
    """An FFT of a linear layer; ``bad``: its output divided by zero where the real part is
    small (NaN and infinities in the complex values)."""

    def __init__(self, bad: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bad = bad

    def forward(self, x):
        z = torch.fft.fft(self.lin(x), dim=-1)
        return z / (z.real.detach() > 100).to(z.dtype) if self.bad else z


class _RealPart(nn.Module):
    def forward(self, z):
        return z.real + z.imag


def test_a_nan_made_in_a_complex_value_is_found_where_it_is_made():
    """A complex NaN was skipped (only floating tensors were checked): the next module, which
    made the first real NaN, was named as the origin and the complex input read as absmax 0."""
    torch.manual_seed(0)
    net = nn.Sequential(_Spectrum(), _RealPart(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    o = hs.find_nonfinite(net, x)
    assert (o.layer, o.phase, o.kind, o.module_type) == ("0", "forward", "nan", "_Spectrum")
    with torch.no_grad():
        h, z = net[0].lin(x), net[0](x)
    assert o.stats["output_nan"] == float(z.isnan().sum()) > 0
    assert o.stats["output_inf"] == float(z.isinf().sum())
    assert o.stats["input_absmax"] == pytest.approx(x.abs().max().item())
    assert torch.isfinite(h).all()
    # a finite complex model: nothing found, forward or backward
    torch.manual_seed(0)
    fine = nn.Sequential(_Spectrum(bad=False), _RealPart(), nn.Linear(8, 2))
    assert hs.find_nonfinite(fine, x) is None
