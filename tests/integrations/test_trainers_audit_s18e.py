"""Audit s18e of the trainer callbacks: a record's step is the trainer's (a resumed run goes on
from the checkpoint's step, as the trainer's own logs do), and a trainer that clips the
gradients says that the records' parameter gradients are the clipped ones."""

from __future__ import annotations

import copy
import csv
import glob
import math
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from helpers.trainers import NOISE, base, data, fresh_accelerate_state

pytestmark = pytest.mark.filterwarnings(*NOISE)
_fresh_accelerate_state = pytest.fixture(autouse=True)(fresh_accelerate_state)
_base, _data = base, data


def _module(base: nn.Module, seen: list | None = None):
    """A LightningModule training a copy of ``base``, noting each batch in ``seen``."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(base)

        def training_step(self, batch, i):
            if seen is not None:
                seen.append((batch[0].clone(), batch[1].clone()))
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _trainer(tmp_path, cb, **kw):
    import lightning as L

    return L.Trainer(
        **{
            "callbacks": cb if isinstance(cb, list) else [cb],
            "logger": False,
            "accelerator": "cpu",
            "devices": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "default_root_dir": str(tmp_path),
            "log_every_n_steps": 1,
            **kw,
        }
    )


def _csv_rows(folder) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    (path,) = glob.glob(str(folder / "lightning_logs" / "*" / "metrics.csv"))
    with open(path) as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if k != "step" and v != ""}
            rows.setdefault(int(row["step"]), {}).update(vals)
    return rows


def test_lightning_resumed_run_records_go_on_from_the_checkpoint_step(tmp_path):
    """Resumed from a checkpoint after 2 optimizer steps, the callback's records were numbered
    0, 1 again and sent to the loggers at steps 0, 1, over the first run's records, while
    Lightning logged the same steps' own values (the learning rate) at 2, 3, silently. Now they are 2, 3, and a
    record holds the values of a plain loop that runs the same 4 steps."""
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb = HookscopeCallback(every=1, alerts="off")
    first = _trainer(tmp_path, cb, max_steps=2)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    first.fit(_module(base, seen), loader)
    ckpt = str(tmp_path / "two.ckpt")
    first.save_checkpoint(ckpt)
    assert [r.step for r in cb.records] == [0, 1]

    cb2 = HookscopeCallback(every=1, alerts="off")
    # Lightning's own per-step values (the learning rate) stand for the run's other metrics
    lr = LearningRateMonitor(logging_interval="step")
    second = _trainer(tmp_path, [cb2, lr], max_steps=4, logger=CSVLogger(tmp_path / "csv"))
    second.fit(_module(base, seen), loader, ckpt_path=ckpt)
    assert len(seen) == 4
    assert [r.step for r in cb2.records] == [2, 3]
    rows = _csv_rows(tmp_path / "csv")
    assert sorted(s for s, r in rows.items() if "hookscope/net.0/mean" in r) == [2, 3]
    assert sorted(s for s, r in rows.items() if "lr-SGD" in r) == [2, 3]

    # the values: a plain loop over the same 4 batches, records of steps 2 and 3
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, alerts="off") as mon:
        for bx, by in seen:
            F.cross_entropy(net(bx), by).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        want = {r.step: r for r in mon.records}
    for rec in cb2.records:
        for key, v in want[rec.step].layers["1"].items():
            got = rec.layers["net.1"][key]
            assert math.isclose(got, v, rel_tol=2e-5, abs_tol=1e-7), (rec.step, key, got, v)
        assert math.isclose(
            rows[rec.step]["hookscope/net.1/mean"], want[rec.step].layers["1"]["mean"], rel_tol=1e-5
        )


def test_lightning_resumed_run_logs_on_the_every_grid_of_the_whole_run(tmp_path):
    """every=2 across a resume at step 3: steps 4 (not 3, 5) are logged, as in one long run."""
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(24)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    first = _trainer(tmp_path, HookscopeCallback(every=2, alerts="off"), max_steps=3)
    first.fit(_module(base), loader)
    ckpt = str(tmp_path / "three.ckpt")
    first.save_checkpoint(ckpt)
    cb2 = HookscopeCallback(every=2, alerts="off")
    _trainer(tmp_path, cb2, max_steps=6).fit(_module(base), loader, ckpt_path=ckpt)
    assert [r.step for r in cb2.records] == [4]


def test_monitor_first_step_numbers_and_logs_as_a_continued_run():
    """Monitor(first_step=N): records numbered from N, logged on the every-grid; bad values
    refused."""
    net = _base()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, every=2, first_step=3, alerts="off") as mon:
        for _ in range(3):
            F.cross_entropy(net(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        assert [r.step for r in mon.records] == [4]
        assert mon.step_index == 6
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="first_step"):
            hs.Monitor(net, first_step=bad)


def _hf(tmp_path, base, seen, **kw):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from helpers.trainers import hf_trainer

    x, y = _data(24)
    samples = [{"x": x[i], "labels": y[i]} for i in range(24)]
    return hf_trainer(str(tmp_path / "hf"), copy.deepcopy(base), seen, samples, **kw)


def test_hf_resumed_run_records_go_on_from_the_checkpoint_step(tmp_path):
    """Resumed from checkpoint-2, the HF callback's records (and so its own sinks) were
    numbered 0, 1 again, while ``trainer.log`` put them at the Trainer's steps 3, 4: the JSONL
    file of the run held steps 0, 1 twice, silently. Now the records are 2, 3 and the values are
    those of a plain loop over the same micro-batches."""
    pytest.importorskip("transformers")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base = _base()
    seen: list = []
    first = _hf(tmp_path, base, seen, save_strategy="steps", save_steps=2)
    first.add_callback(HookscopeTrainerCallback(first, every=1, alerts="off"))
    first.train()
    ckpt = str(tmp_path / "hf" / "checkpoint-2")
    second = _hf(tmp_path, base, seen, max_steps=4)
    jsonl = tmp_path / "second.jsonl"
    cb = HookscopeTrainerCallback(second, every=1, alerts="off", sinks=[hs.JsonlSink(jsonl)])
    second.add_callback(cb)
    second.train(resume_from_checkpoint=ckpt)
    assert [r.step for r in cb.records] == [2, 3]
    import json

    with open(jsonl) as f:
        assert [json.loads(line)["step"] for line in f] == [2, 3]
    hist = [h for h in second.state.log_history if any(k.startswith("hookscope/") for k in h)]
    # trainer.log: the Trainer's global_step after each step, the first run's kept in the state
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    assert len(seen) == 8  # 4 steps of 2 micro-batches

    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, alerts="off") as mon:
        for k in range(4):
            for bx, by in seen[2 * k : 2 * k + 2]:
                (F.cross_entropy(net(bx), by) / 2).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        want = {r.step: r for r in mon.records}
    for rec in cb.records:
        for key, v in want[rec.step].layers["1"].items():
            got = rec.layers["net.1"][key]
            assert math.isclose(got, v, rel_tol=2e-5, abs_tol=1e-7), (rec.step, key, got, v)


def _clipped_reference(base, batches, max_norm):
    """A plain loop that clips with ``clip_grad_norm_``: per step, each parameter's gradient
    norm before and after clipping."""
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before, after = [], []
    for micro in batches:
        for bx, by in micro:
            (F.cross_entropy(net(bx), by) / len(micro)).backward()
        before.append({n: p.grad.norm().item() for n, p in net.named_parameters()})
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        after.append({n: p.grad.norm().item() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
    return before, after


def test_lightning_gradient_clipping_is_said_and_records_hold_the_clipped_gradients(tmp_path):
    """With ``gradient_clip_val`` the records' parameter ``grad_norm`` are those of the clipped
    gradients (Lightning clips after ``on_before_optimizer_step``): 0.5 in total where backward
    gave 1.6, so an exploding gradient never showed, and nothing said so. Now a warning names
    the setting at the start; the values equal ``clip_grad_norm_``'s in a plain loop."""
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(8, scale=50.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    seen: list = []
    cb = HookscopeCallback(every=1, alerts="off")
    with pytest.warns(hs.HookscopeWarning, match=r"gradient_clip_val=0\.5.*clipped"):
        _trainer(tmp_path, cb, max_steps=2, gradient_clip_val=0.5).fit(_module(base, seen), loader)
    before, after = _clipped_reference(base, [[b] for b in seen], 0.5)
    assert math.sqrt(sum(v**2 for v in before[0].values())) > 1.0  # clipping did act
    for rec, want in zip(cb.records, after):
        for n, v in want.items():
            got = rec.params[f"net.{n}"]["grad_norm"]
            assert math.isclose(got, v, rel_tol=1e-5, abs_tol=1e-7), (rec.step, n, got, v)
    # no clipping, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        _trainer(tmp_path, HookscopeCallback(alerts="off"), max_steps=1).fit(_module(base), loader)


def test_hf_gradient_clipping_is_said_and_records_hold_the_clipped_gradients(tmp_path):
    """``max_grad_norm`` (1.0 by default) clips before ``on_optimizer_step``: the same, for the
    HF Trainer; the Trainer's own logged ``grad_norm`` is the norm before clipping."""
    pytest.importorskip("transformers")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base = _base()
    seen: list = []
    trainer = _hf(tmp_path, base, seen, max_grad_norm=0.5, max_steps=2)
    x, y = _data(24, scale=50.0)
    trainer.train_dataset = [{"x": x[i], "labels": y[i]} for i in range(24)]
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    with pytest.warns(hs.HookscopeWarning, match=r"max_grad_norm=0\.5.*clipped"):
        trainer.train()
    before, after = _clipped_reference(base, [seen[0:2], seen[2:4]], 0.5)
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    for got, want in zip(logged, before):  # the Trainer logs the norm before clipping
        assert math.isclose(got, math.sqrt(sum(v**2 for v in want.values())), rel_tol=1e-4)
    assert logged[0] > 0.55  # clipping did act
    for rec, want in zip(cb.records, after):
        for n, v in want.items():
            got = rec.params[f"net.{n}"]["grad_norm"]
            assert math.isclose(got, v, rel_tol=1e-5, abs_tol=1e-7), (rec.step, n, got, v)


def test_lightning_several_optimizer_steps_in_one_batch_are_said(tmp_path):
    """Manual optimization stepping two optimizers per batch (a GAN): the callback makes one
    record per batch, read after the last optimizer's step, so the first optimizer's
    parameters show the sum of both backward passes' gradients (not the one it stepped with),
    silently. Now a warning says so, naming how many steps the batch took; the record holds
    what a plain loop's monitor reads after the batch."""
    pytest.importorskip("lightning")
    import lightning as L

    from hookscope.integrations.lightning import HookscopeCallback

    base = _base()
    x, y = _data(8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    class Gan(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(base)
            self.automatic_optimization = False

        def training_step(self, batch, i):
            first, second = self.optimizers()
            for opt in (first, second):
                opt.zero_grad()
                self.manual_backward(F.cross_entropy(self.net(batch[0]), batch[1]))
                opt.step()

        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

    cb = HookscopeCallback(every=1, alerts="off")
    with pytest.warns(hs.HookscopeWarning, match=r"2 optimizer steps in one training batch"):
        _trainer(tmp_path, cb, max_steps=2).fit(Gan(), loader)
    assert [r.step for r in cb.records] == [0]

    net = copy.deepcopy(base)
    opts = [
        torch.optim.SGD(net[0].parameters(), lr=0.1),
        torch.optim.SGD(net[2].parameters(), lr=0.1),
    ]
    with hs.Monitor(net, alerts="off") as mon:
        for opt in opts:
            opt.zero_grad()
            F.cross_entropy(net(x[:4]), y[:4]).backward()
            opt.step()
        want = mon.step(opts[1])
    assert want is not None
    for n, d in want.params.items():
        got = cb.records[0].params[f"net.{n}"]["grad_norm"]
        assert math.isclose(got, d["grad_norm"], rel_tol=1e-5, abs_tol=1e-7), (n, got, d)


class _Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def test_lightning_sentinel_leaves_a_validation_nan_out(tmp_path):
    """A validation batch on which a layer makes a NaN (sqrt of a negative; between training
    steps, while the callback has the monitor paused) was reported by the sentinel as the next
    training step's NaN origin, with a NonFiniteWarning, silently wrong: training stayed finite.
    Now no record has one; a NaN that training makes is still named."""
    pytest.importorskip("lightning")
    import lightning as L

    from hookscope.integrations.lightning import HookscopeCallback

    torch.manual_seed(0)
    base = nn.Sequential(_Sqrt(), nn.Linear(6, 3))
    x, y = _data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(base)

        def training_step(self, batch, i):
            x = batch[0].abs() if i < 3 else -batch[0].abs() - 1  # the last step: a NaN
            return F.cross_entropy(self.net(x), batch[1])

        def validation_step(self, batch, i):
            assert torch.isnan(self.net(-batch[0].abs() - 1)).all()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = HookscopeCallback(every=1, sentinel=True, alerts="off")
    _trainer(tmp_path, cb, max_steps=4, val_check_interval=1, limit_val_batches=1).fit(
        Module(), loader, loader
    )
    assert [r.step for r in cb.records] == [0, 1, 2, 3]
    assert [r.nonfinite for r in cb.records[:3]] == [None] * 3
    last = cb.records[3].nonfinite
    assert last is not None and (last.layer, last.phase, last.kind) == ("net.0", "forward", "nan")
