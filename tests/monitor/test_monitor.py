"""Monitor: every recorded statistic equals the value computed directly from the tensors."""

from __future__ import annotations

import copy
import json
import math
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from helpers.common import Boxing
from hookscope.monitor._stats import Scratch, act_stats, grad_stats

REL = 1e-5


def close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def values(v) -> list[float]:
    """A statistics vector (a list on CPU, a tensor on CUDA) as floats."""
    return list(v) if isinstance(v, list) else v.tolist()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def direct(
    net: nn.Sequential, x: torch.Tensor, scale: float = 1.0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer output and the gradient of ``loss`` w.r.t. it, computed by hand."""
    outs, h = [], x
    for layer in net:
        h = layer(h)
        h.retain_grad()
        outs.append(h)
    (h.pow(2).mean() * scale).backward()
    return [o.detach() for o in outs], [o.grad for o in outs]


def act_expect(o: torch.Tensor) -> dict[str, float]:
    o = o.float()
    return {
        "mean": o.mean().item(),
        "std": o.std().item(),
        "absmax": o.abs().max().item(),
        "zeros": (o == 0).float().mean().item(),
        "nonfinite": float((~torch.isfinite(o)).sum()),
    }


def test_layer_and_parameter_stats_equal_direct_values():
    net = mlp()
    ref = mlp()
    x = torch.randn(32, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with hs.Monitor(net, alerts="off") as mon:
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        net(x).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        rec = mon.step(opt)
        opt.zero_grad()
    outs, ograds = direct(ref, x)
    assert list(rec.layers) == ["0", "1", "2", "3", "4"]
    for i, (o, g) in enumerate(zip(outs, ograds)):
        got = rec.layers[str(i)]
        for k, v in act_expect(o).items():
            assert close(got[k], v), (i, k, got[k], v)
        assert close(got["grad_norm"], g.norm().item())
        assert close(got["grad_absmax"], g.abs().max().item())
    assert close(rec.layers["1"]["saturated"], (outs[1].abs() >= 0.98).float().mean().item())
    assert "saturated" not in rec.layers["3"]
    for n, p in net.named_parameters():
        got = rec.params[n]
        assert close(got["grad_norm"], grads[n].norm().item())
        assert close(got["weight_norm"], p.detach().norm().item())
        assert close(
            got["update_ratio"], ((p.detach() - before[n]).norm() / before[n].norm()).item()
        )


def test_every_n_attaches_hooks_only_for_logged_steps():
    net = mlp()
    mon = hs.Monitor(net, every=3, alerts="off")
    attached = []
    try:
        for _ in range(7):
            attached.append(len(hs.hooks_on(net[0])) > 0)
            net(torch.randn(2, 4)).sum().backward()
            mon.step()
            net.zero_grad()
    finally:
        mon.close()
    assert attached == [True, False, False, True, False, False, True]
    assert [r.step for r in mon.records] == [0, 3, 6]
    assert "update_ratio" not in mon.records[0].params["0.weight"]  # no optimizer given
    assert all(not hs.hooks_on(m) for m in net.modules())


def test_stats_groups_and_parameters_without_gradient():
    net = mlp()
    net[4].weight.requires_grad_(False)
    net[2].bias.grad = None
    with hs.Monitor(net, stats=("parameters",), alerts="off") as mon:
        assert not hs.hooks_on(net[0])  # no module hook needed for parameter statistics
        with torch.no_grad():
            net(torch.randn(2, 4))
        rec = mon.step()
    assert rec.layers == {}
    assert "4.weight" not in rec.params
    assert "grad_norm" not in rec.params["2.bias"]  # no gradient: reported as missing, never 0
    with pytest.raises(ValueError, match="unknown stats group"):
        hs.Monitor(net, stats=("bogus",))
    with pytest.raises(ValueError, match="every"):
        hs.Monitor(net, every=0)


def test_reused_module_records_every_call():
    relu = nn.ReLU()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(3, 3), relu

        def forward(self, x):
            a = self.act(self.fc(x))
            return self.act(a - 0.5)

    torch.manual_seed(0)
    net = Twice()
    x = torch.randn(5, 3)
    with hs.Monitor(net, alerts="off") as mon:
        net(x).sum().backward()
        rec = mon.step()
    a = torch.relu(net.fc(x)).detach()
    b = torch.relu(a - 0.5)
    assert close(rec.layers["act"]["mean"], a.mean().item())
    assert close(rec.layers["act#1"]["mean"], b.mean().item())
    assert close(rec.layers["act#1"]["zeros"], (b == 0).float().mean().item())


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(1000) * 0.01 + 100.0,  # large mean: the CPU path falls back to two passes
        torch.tensor([1.0, float("nan"), 0.0, float("inf"), -2.0]),
        torch.tensor([0.0, float("-inf"), 3.0]),
        torch.tensor([2.5]),
    ],
)
def test_act_stats_cpu_paths_match_torch(x):
    v, _ = act_stats(x, None, 0.01, 0, Scratch())
    mean, std, absmax, nonzero, finite = values(v)
    exp_std = x.std().item() if x.numel() > 1 else math.nan
    assert close(mean, x.mean().item()) or (math.isnan(mean) and math.isnan(x.mean().item()))
    assert close(std, exp_std, 1e-6) or (math.isnan(std) and math.isnan(exp_std))
    am = x.abs().max().item()
    assert close(absmax, am) or (math.isnan(absmax) and math.isnan(am))
    assert nonzero == float(torch.count_nonzero(x))
    assert finite == float(torch.isfinite(x).sum())


def test_autocast_stats_are_fp32_of_the_low_precision_values():
    net = mlp()
    x = torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out0 = net[0](x)  # the reference, outside the monitor
    with hs.Monitor(net, stats=("activations",), alerts="off") as mon:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(x)
        rec = mon.step()
    assert out0.dtype == torch.bfloat16
    exp = act_expect(out0.detach())
    for k in ("mean", "std", "absmax"):
        assert close(rec.layers["0"][k], exp[k]), k


@pytest.mark.parametrize("order", ["before_scaler_step", "after_update"])
def test_grad_scaler_reports_unscaled_gradients(order):
    net, ref = mlp(), mlp()
    x = torch.randn(16, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with hs.Monitor(net, scaler=scaler, alerts="off") as mon:
        scaler.scale(net(x).pow(2).mean()).backward()
        if order == "before_scaler_step":
            rec = mon.step(opt)
            scaler.step(opt)
            scaler.update()
        else:
            scaler.step(opt)
            scaler.update()
            rec = mon.step(opt)
    _, ograds = direct(ref, x)
    for i, g in enumerate(ograds):
        assert close(rec.layers[str(i)]["grad_norm"], g.norm().item())
    for n, p in ref.named_parameters():
        assert close(rec.params[n]["grad_norm"], p.grad.norm().item())


def test_checkpointing_does_not_double_count():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)

        def forward(self, x, ckpt=False):
            h = self.a(x)
            h = checkpoint(self.b, h, use_reentrant=False) if ckpt else self.b(h)
            return self.c(h)

    x = torch.randn(5, 4)
    recs = []
    for ckpt in (False, True):
        net = Net()
        with hs.Monitor(net, alerts="off") as mon:
            net(x, ckpt=ckpt).sum().backward()
            recs.append(mon.step())
    assert list(recs[0].layers) == list(recs[1].layers) == ["a", "b", "c"]
    for k in recs[0].layers:
        for s, v in recs[0].layers[k].items():
            assert close(recs[1].layers[k][s], v), (k, s)


def test_model_left_as_found_and_ddp_style_wrapper_names():
    net = mlp().eval()
    wrapped = nn.DataParallel(net)  # CPU DataParallel just calls the module
    with hs.Monitor(wrapped, alerts="off") as mon:
        wrapped(torch.randn(3, 4)).sum().backward()
        rec = mon.step()
    assert "0.weight" in rec.params and "0" in rec.layers
    assert not net.training
    assert all(not hs.hooks_on(m) for m in net.modules())


def test_jsonl_tensorboard_and_callable_sinks(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    net = mlp()
    seen = []
    jl = tmp_path / "m.jsonl"
    tb = hs.TensorBoardSink(str(tmp_path / "tb"), histograms=True)
    with hs.Monitor(net, sinks=[hs.JsonlSink(jl), tb, seen.append], alerts="off") as mon:
        assert mon.bins == 32
        for _ in range(2):
            net(torch.randn(8, 4)).pow(2).mean().backward()
            mon.step()
            net.zero_grad()
    lines = [json.loads(s) for s in jl.read_text().splitlines()]
    assert [d["step"] for d in lines] == [0, 1] == [r.step for r in seen]
    assert lines[1]["layers"]["0"]["mean"] == seen[1].layers["0"]["mean"]
    counts = seen[1].histograms["activations/0"][1]
    assert sum(counts) == 8 * 8
    ea = EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0}
    ).Reload()
    sc = ea.Scalars("grad_norm/2")
    assert [e.step for e in sc] == [0, 1]
    assert math.isclose(sc[1].value, seen[1].layers["2"]["grad_norm"], rel_tol=1e-6)
    assert "activations/0" in ea.Tags()["histograms"]


def test_jsonl_sink_makes_its_folder(tmp_path):
    path = tmp_path / "runs" / "a" / "m.jsonl"
    sink = hs.JsonlSink(path)
    sink(hs.MonitorRecord(step=2, layers={"fc": {"mean": 0.25}}))
    sink.close()
    assert json.loads(path.read_text())["layers"] == {"fc": {"mean": 0.25}}


def test_grad_flow_plot_png(tmp_path):
    net = mlp()
    with hs.Monitor(net, alerts="off") as mon:
        for _ in range(3):
            net(torch.randn(8, 4)).sum().backward()
            mon.step()
            net.zero_grad()
    path = tmp_path / "flow.png"
    fig = mon.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == [n for n, _ in net.named_parameters()]
    fig2 = hs.plot_grad_flow(list(mon.records), source="layers")
    assert len(fig2.axes[0].patches) == 2 * 5
    with pytest.raises(ValueError, match="no finite"):
        hs.plot_grad_flow([hs.MonitorRecord(0)])


def test_close_is_idempotent_and_nothing_keeps_the_model_alive():
    net = mlp()
    mon = hs.Monitor(net, sentinel=True, alerts="off")
    net(torch.randn(2, 4)).sum().backward()
    assert mon.step() is not None
    alive = weakref.ref(net)
    mon.close()
    mon.close()
    assert mon.step() is None
    assert all(not hs.hooks_on(m) for m in net.modules())
    mon2 = hs.Monitor(net, alerts="off")  # left attached: dropping monitor and model frees both
    net(torch.randn(2, 4)).sum().backward()
    del mon, mon2, net
    assert alive() is None  # no gc.collect(): no reference cycle through the hooks


def _f64_stats(x: torch.Tensor) -> list[float]:
    d = x.double()
    return [
        d.mean().item(),
        d.std().item(),
        d.abs().max().item(),
        float((x != 0).sum()),
        float(torch.isfinite(x).sum()),
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(5_000_000, generator=g).relu_() * 3 + 0.5,  # large: blocked dots
        # spread tiny against a mean half-way between two fp32 numbers, over many blocks: the
        # centred second pass must correct for its shift (the mean rounded to fp32)
        lambda g: (
            torch.randn(300_000, generator=g, dtype=torch.float64) * 1e-3 + 1000.00003
        ).float(),
        lambda g: torch.randn(4, 6, 5, 7, generator=g).to(memory_format=torch.channels_last),
        lambda g: torch.randn(9, 13, generator=g).t(),  # transposed: read without a copy
        lambda g: torch.tensor([0.0, -0.0, 1.0, -2.0, 0.0]),  # -0.0 is a zero
        lambda g: torch.rand(1000, generator=g) + 1.0,  # all positive: no zero possible
        lambda g: torch.randn(3000, generator=g).bfloat16(),
    ],
    ids=[
        "5M-relu",
        "large-mean",
        "channels-last",
        "transposed",
        "signed-zeros",
        "positive",
        "bf16",
    ],
)
def test_act_and_grad_stats_cpu_equal_float64_references(make):
    """The CPU statistics against float64 computations: accurate to ~1e-7 even on 5M elements
    (torch's fp32 2-norm is off by ~1e-4 there), in any memory layout."""
    from hookscope.monitor._stats import cpu_norm, grad_stats

    x = make(torch.Generator().manual_seed(0))
    v, _ = act_stats(x, None, 0.01, 0, Scratch())
    ref = _f64_stats(x.float())
    for got, exp in zip(values(v), ref):
        assert close(got, exp, 1e-6), (got, exp)
    norm, mn, mx = values(grad_stats(x))
    assert close(norm, x.double().norm().item(), 1e-6)
    assert (mn, mx) == (x.min().item(), x.max().item())
    assert close(cpu_norm(x), x.double().norm().item(), 1e-6)


def test_act_and_grad_stats_see_a_nan_in_any_block():
    """Statistics are taken block by block (256 KiB): a NaN in a middle block must survive the
    blocks after it, in min/max/absmax as in the counts."""
    from hookscope.monitor._stats import grad_stats

    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    x[300_000] = float("nan")
    x[900_000] = 0.0
    v, _ = act_stats(x, None, 0.01, 0, Scratch())
    mean, std, absmax, nonzero, finite = values(v)
    assert math.isnan(mean) and math.isnan(std) and math.isnan(absmax) and finite == x.numel() - 1
    assert nonzero == float(torch.count_nonzero(x))
    norm, mn, mx = values(grad_stats(x))
    assert math.isnan(norm) and math.isnan(mn) and math.isnan(mx)


def test_expanded_and_strided_tensors_are_read_as_their_values():
    """Statistics of a stride-0 (expanded) or strided tensor are those of its values, not of the
    memory next to them (which here holds other values, so a dense read would show)."""
    base = torch.arange(5000, dtype=torch.float32)
    cases = [
        base[:1].expand(4000),  # 4000 zeros; a dense read of base gives mean 1999.5
        base[:2].reshape(1, 2).expand(1000, 2),
        base[::3],
        base.reshape(50, 100)[:, :40],
    ]
    for x in cases:
        d = x.double()
        v, _ = act_stats(x, None, 0.01, 0, Scratch())
        assert math.isclose(v[0], float(d.mean()), rel_tol=1e-6, abs_tol=1e-9), x.stride()
        assert math.isclose(v[1], float(d.std()), rel_tol=1e-6, abs_tol=1e-9), x.stride()
        assert v[2:] == [float(d.abs().max()), float(torch.count_nonzero(d)), float(d.numel())]
        norm, mn, mx = grad_stats(x)
        assert math.isclose(norm, float(d.norm()), rel_tol=1e-6) and (mn, mx) == (d.min(), d.max())


def test_old_style_weight_norm_is_not_taken_for_fsdp1():
    """``torch.nn.utils.weight_norm`` leaves ``weight`` a plain tensor, as FSDP1 does with
    ``use_orig_params=False``: only the latter is refused (tests/suites/test_sharded.py)."""
    import torch.distributed.fsdp  # FSDP1 imported, no process group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        net = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 3)), nn.ReLU(), nn.Linear(3, 1))
    with hs.Monitor(net, alerts="off") as mon:
        net(torch.randn(5, 4)).sum().backward()
        rec = mon.step()
    assert set(rec.params) == {"0.weight_g", "0.weight_v", "0.bias", "2.weight", "2.bias"}
    assert math.isclose(
        rec.params["0.weight_v"]["grad_norm"], float(net[0].weight_v.grad.norm()), rel_tol=1e-6
    )


def test_statistics_of_large_finite_values_are_exact_not_inf():
    """Activations near 1e20 (finite in fp32): each block's fp32 dot overflowed, so the std read
    inf beside nonfinite 0 and a parameter gradient's norm (1e39) inf, with NumPy's overflow
    warning leaking out. Blocks that overflow are summed in float64, as the guide says."""
    import warnings

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Identity(), nn.Linear(64, 1))
    with torch.no_grad():
        net[0].weight.mul_(1e20)
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref_std = net[0](x).double().std().item()
    net2 = copy.deepcopy(net)
    (net2(x).sum() * 1e18).backward()
    ref_norm = net2[2].weight.grad.double().norm().item()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with hs.Monitor(net, every=1, alerts="off") as mon:
            (net(x).sum() * 1e18).backward()
            mon.step()
    rec = mon.records[-1]
    assert rec.layers["0"]["std"] == pytest.approx(ref_std, rel=1e-5)
    assert rec.layers["0"]["nonfinite"] == 0.0
    assert rec.params["2.weight"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


class _Spectrum(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x, dim=-1)


class _Parts(nn.Module):
    def forward(self, z):
        return z.real + z.imag


def test_a_layer_giving_complex_values_has_the_statistics_of_their_parts():
    """An FFT layer's output (complex) had no row at all, silently: its statistics are now those
    of its real and imaginary parts (``view_as_real``), activations and gradient, as computed by
    hand."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), _Spectrum(), _Parts(), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    with hs.Monitor(net, alerts="off") as mon:
        net(x).pow(2).mean().backward()
        rec = mon.step()
    assert list(rec.layers) == ["0", "1", "2", "3"]
    h = net[0](x).detach()
    z = torch.fft.fft(h, dim=-1).requires_grad_()
    net[3](net[2](z)).pow(2).mean().backward()
    parts, gparts = torch.view_as_real(z.detach()), torch.view_as_real(z.grad)
    got = rec.layers["1"]
    for k, v in act_expect(parts).items():
        assert close(got[k], v), (k, got[k], v)
    assert close(got["grad_norm"], gparts.norm().item())
    assert close(got["grad_absmax"], gparts.abs().max().item())


class _Unbox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.out = Boxing(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.enc(x).h))


def test_a_layer_returning_its_tensor_inside_an_object_has_its_statistics():
    """``enc`` returns ``Box(h)``: it had no row (its output holds no tensor in a tuple, list,
    dict or dataclass), silently; its statistics are now those of ``h``, activation and
    gradient, as computed by hand."""
    torch.manual_seed(0)
    net, x = _Unbox(), torch.randn(16, 4)
    with hs.Monitor(net, layers=["enc", "out"], alerts="off") as mon:
        net(x).pow(2).mean().backward()
        rec = mon.step()
    assert "enc" in rec.layers
    h = net.enc.lin(x).detach().requires_grad_()
    net.out(torch.tanh(h)).pow(2).mean().backward()
    for k, v in act_expect(h.detach()).items():
        assert close(rec.layers["enc"][k], v), (k, rec.layers["enc"][k], v)
    assert close(rec.layers["enc"]["grad_norm"], h.grad.norm().item())
