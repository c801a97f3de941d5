"""Audit s20 of the trainer integrations: each record is compared with a hand-written loop taking
the same optimizer steps on the same micro-batches, its statistics computed with plain PyTorch
(forward hooks, tensor gradient hooks, ``.grad`` and the weights before and after the step)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from helpers.trainers import NOISE, base, data, fresh_accelerate_state, lightning_module

pytestmark = pytest.mark.filterwarnings(*NOISE)
_fresh_accelerate_state = pytest.fixture(autouse=True)(fresh_accelerate_state)
_base, _data = base, data


def _ref_hook(name: str, acts: dict, grads: dict):
    """A plain forward hook keeping the output and, through a tensor hook, its gradient."""

    def hook(mod, args, o):
        acts.setdefault(name, []).append(o.detach().double().flatten())
        o.register_hook(lambda g: grads.setdefault(name, []).append(g.double().flatten()))

    return hook


def _reference(
    net: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], div: float
) -> list[dict]:
    """Plain SGD(0.1) on ``steps`` (micro-batches of each optimizer step, each loss divided by
    ``div``) with plain hooks: per step the leaf layers' activation mean/std/absmax and output
    gradient norm over all micro-batches, each parameter's gradient norm, weight norm and
    ``|w_after - w_before| / |w_before|``."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    leaves = {n: m for n, m in net.named_modules() if n and not list(m.children())}
    out = []
    for micro in steps:
        acts: dict[str, list[torch.Tensor]] = {}
        grads: dict[str, list[torch.Tensor]] = {}
        handles = [m.register_forward_hook(_ref_hook(n, acts, grads)) for n, m in leaves.items()]
        before = {n: p.detach().double().clone() for n, p in net.named_parameters()}
        try:
            for x, y in micro:
                (F.cross_entropy(net(x), y) / div).backward()
        finally:
            for h in handles:
                h.remove()
        gnorm = {n: p.grad.double().norm().item() for n, p in net.named_parameters()}
        opt.step()
        rec: dict = {"layers": {}, "params": {}}
        for n, a in acts.items():
            v = torch.cat(a)
            g = torch.cat(grads[n])
            rec["layers"][n] = {
                "mean": v.mean().item(),
                "std": v.std().item(),
                "absmax": v.abs().max().item(),
                "grad_norm": g.norm().item(),
            }
        for n, p in net.named_parameters():
            w = p.detach().double()
            rec["params"][n] = {
                "grad_norm": gnorm[n],
                "weight_norm": w.norm().item(),
                "update_ratio": (w - before[n]).norm().item() / before[n].norm().item(),
            }
        opt.zero_grad()
        out.append(rec)
    return out


def _assert_matches(rec: hs.MonitorRecord, want: dict, prefix: str = "net.") -> None:
    """Every statistic of the reference is in the record, equal (relative 1e-5)."""
    bad = []
    for kind in ("layers", "params"):
        got_all = getattr(rec, kind)
        for name, stats in want[kind].items():
            got = got_all.get(prefix + name, {})
            for k, v in stats.items():
                g = got.get(k, math.nan)
                if not math.isclose(g, v, rel_tol=1e-5, abs_tol=1e-8):
                    bad.append((rec.step, name, k, g, v))
    assert not bad, bad


# -- Lightning --------------------------------------------------------------------------------


def _trainer(cb, **kw):
    import lightning as L

    return L.Trainer(
        **{
            "callbacks": [cb],
            "logger": False,
            "accelerator": "cpu",
            "devices": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            **kw,
        }
    )


def _manual_module(base: nn.Module, seen: list, set_to_none: bool):
    """Manual optimization accumulating 2 batches as Lightning's documentation shows it:
    ``opt.step(); opt.zero_grad()`` at the end of the accumulation."""
    import lightning as L

    class Manual(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(base)
            self.automatic_optimization = False

        def training_step(self, batch, i):
            seen.append((batch[0].clone(), batch[1].clone()))
            opt = self.optimizers()
            self.manual_backward(F.cross_entropy(self.net(batch[0]), batch[1]) / 2)
            if (i + 1) % 2 == 0:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Manual()


def test_lightning_manual_optimization_zeroing_after_the_step_keeps_the_gradients_it_used():
    """Manual optimization that zeroes the gradients right after ``opt.step()`` (Lightning's
    own accumulation example): the callback reads the record at the batch's end, when every
    ``.grad`` was already ``None``, so each record had no parameter ``grad_norm`` at all, without
    a word (the reference: 0.15 to 0.52 per parameter). The gradients the step used are kept
    (references) at ``on_before_optimizer_step`` and given back for the record."""
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    seen: list = []
    cb = HookscopeCallback(every=1, alerts="off")
    module = _manual_module(base, seen, set_to_none=True)
    _trainer(cb, max_steps=2).fit(module, loader)
    want = _reference(copy.deepcopy(base), [seen[0:2], seen[2:4]], div=2)
    assert [r.step for r in cb.records] == [0, 1]
    for rec, w in zip(cb.records, want):
        _assert_matches(rec, w)
    assert all(p.grad is None for p in module.parameters())  # as training_step left them


def test_lightning_manual_optimization_zeroing_in_place_after_the_step_is_said():
    """``opt.zero_grad(set_to_none=False)`` after ``opt.step()``: the gradients the step used
    are zeros when the record is read (grad_norm 0, and a vanishing alert), which no reference
    can give back without a copy: a MonitorWarning names the parameters and the fix."""
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb = HookscopeCallback(every=1, alerts="off")
    with pytest.warns(hs.MonitorWarning, match=r"'net\.0\.weight'.*changed in place.*set_to_none"):
        _trainer(cb, max_steps=2).fit(_manual_module(base, [], set_to_none=False), loader)
    assert cb.records[0].params["net.0.weight"]["grad_norm"] == 0.0


def _auto_module(base: nn.Module, seen: list):
    return lightning_module(base, seen, validation=False)


def test_lightning_compiled_module_is_refused_with_the_lightning_fix():
    """``trainer.fit(torch.compile(module))``: Lightning compiles the module's forward and
    training_step as functions, which run no hook added later; the refusal told the user to
    call ``torch.compile(model)``, which is what they did. It now says what works in Lightning,
    and compiling the network inside the module records exactly what the eager loop does."""
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    module = torch.compile(_auto_module(base, []), backend="aot_eager")
    cb = HookscopeCallback(every=1, alerts="off")
    with pytest.raises(hs.UnsupportedModelError, match=r"self\.net = torch\.compile\(self\.net\)"):
        _trainer(cb, max_steps=1).fit(module, loader)

    seen: list = []
    module = _auto_module(base, seen)
    module.net.compile(backend="aot_eager")
    cb = HookscopeCallback(every=2, alerts="off")
    _trainer(cb, max_steps=3, accumulate_grad_batches=2).fit(module, loader)
    want = _reference(copy.deepcopy(base), [seen[0:2], seen[2:4], seen[4:6]], div=2)
    assert [r.step for r in cb.records] == [0, 2]
    _assert_matches(cb.records[0], want[0])
    _assert_matches(cb.records[1], want[2])


def test_lightning_manual_optimization_zeroing_after_the_step_says_a_skipped_step():
    """The same manual optimization under a GradScaler (``16-mixed`` on the CPU through the
    plugin): with the gradients gone at the batch's end, the step the scaler skipped (an
    overflow in the second step's batch) was recorded ``skipped=False``, with no gradient norm,
    silently. Its record now says ``skipped=True`` and holds the non-finite gradients, and the
    weights it did not move have update_ratio 0."""
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    x[8] = 1e30  # the first batch of the second optimizer step overflows in fp16
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb = HookscopeCallback(every=1, alerts="off")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _trainer(cb, max_steps=2, plugins=[plugin]).fit(_manual_module(base, [], True), loader)
    assert [r.skipped for r in cb.records] == [False, True]
    assert all(math.isfinite(d["grad_norm"]) for d in cb.records[0].params.values())
    assert all(not math.isfinite(d["grad_norm"]) for d in cb.records[1].params.values())
    assert all(d["update_ratio"] == 0.0 for d in cb.records[1].params.values())


def test_tensorboard_histogram_sums_are_those_of_the_values_binned(tmp_path):
    """With gradient accumulation a step's histogram bins its first micro-batch (said), but
    TensorBoardSink wrote its ``sum`` and ``sum_squares`` from the layer's mean and std over
    every micro-batch: a histogram whose sums are not its values' (on this run 0.31x to 4.1x
    theirs: layer 0's sum written 2.85 where its values sum to 6.09; the second micro-batch's
    inputs being 3x the first's). Read back with TensorBoard's
    EventAccumulator, they are now the first micro-batch's, as plain hooks give them."""
    pytest.importorskip("lightning")
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    x[4:8] *= 3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    seen: list = []
    sink = hs.TensorBoardSink(str(tmp_path / "tb"), histograms=True)
    cb = HookscopeCallback(every=1, alerts="off", sinks=[sink])
    with pytest.warns(hs.MonitorWarning, match="first micro-batch only"):
        _trainer(cb, max_steps=1, accumulate_grad_batches=2).fit(_auto_module(base, seen), loader)

    outs: dict[str, torch.Tensor] = {}
    net = copy.deepcopy(base)

    def keep(name):
        def hook(mod, a, o):
            outs[name] = o.detach().double()

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in net.named_children()]
    try:
        net(seen[0][0])  # the first micro-batch
    finally:
        for h in handles:
            h.remove()
    acc = ea_mod.EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    for n, v in outs.items():
        (event,) = acc.Histograms(f"activations/net.{n}")
        h = event.histogram_value
        assert h.num == v.numel()
        assert math.isclose(h.sum, v.sum().item(), rel_tol=1e-5, abs_tol=1e-6), (n, h.sum)
        assert math.isclose(h.sum_squares, (v**2).sum().item(), rel_tol=1e-5), (n, h.sum_squares)
