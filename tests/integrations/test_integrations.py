"""The monitor inside trainers and trackers: Lightning, the Hugging Face Trainer, Accelerate, W&B
and MLflow. Each test reads the values back from the real thing (Lightning's CSV file, an MLflow
file store through MlflowClient, a W&B offline run file) and compares them with what Monitor
computes in an equivalent hand-written loop on the same weights and micro-batches."""

from __future__ import annotations

import copy
import csv
import glob
import importlib
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from helpers.common import mlp6
from helpers.trainers import NOISE, hf_trainer, lightning_module

# the trackers' and trainers' own notices, not ours to fix
pytestmark = pytest.mark.filterwarnings(*NOISE, "ignore::UserWarning:mlflow.*")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state (mixed precision, accumulation) that refuses a
    later Accelerator with other flags: each test starts and ends without one."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


def _data(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _hand_loop(
    net: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], autocast: bool = False
) -> list[hs.MonitorRecord]:
    """Monitor in a plain loop: each step a list of micro-batches, loss divided by their count."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, alerts="off") as mon:
        for micro in steps:
            for x, y in micro:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = F.cross_entropy(net(x), y)
                (loss / len(micro)).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        return list(mon.records)


def _close(a: float, b: float, rel: float = 2e-5) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _assert_same(got: dict[str, float], want: hs.MonitorRecord, rel: float = 2e-5) -> None:
    """``got`` (scalars of a model that holds the network as ``.net``, or not) equals ``want``."""
    got = {
        k.replace("hookscope/net.", "hookscope/").replace("/params/net.", "/params/"): v
        for k, v in got.items()
    }
    exp = want.scalars()
    assert set(got) == set(exp)
    bad = {k: (got[k], exp[k]) for k in exp if not _close(float(got[k]), exp[k], rel)}
    assert not bad, bad


# -- Lightning ----------------------------------------------------------------------------------


_lightning_module = lightning_module


def _lightning_trainer(cb, **kw):
    """2 optimizer steps of 2 micro-batches on the CPU, ``cb`` the only callback."""
    import lightning as L

    return L.Trainer(
        **{
            "max_steps": 2,
            "accumulate_grad_batches": 2,
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


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_callback_one_record_per_optimizer_step_in_the_csv_logger(tmp_path, precision):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from hookscope.integrations.lightning import HookscopeCallback

    base = mlp6()
    x, y = _data(16)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb = HookscopeCallback(every=1, alerts="off")
    trainer = _lightning_trainer(
        cb,
        precision=precision,
        logger=CSVLogger(tmp_path),
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
    )
    trainer.fit(_lightning_module(base, seen), loader, loader)
    assert len(seen) == 4
    want = _hand_loop(
        copy.deepcopy(base),
        [seen[:2], seen[2:]],
        autocast=precision == "bf16-mixed",
    )
    assert [r.step for r in cb.records] == [0, 1]
    rel = 2e-5 if precision == "32-true" else 2e-3
    # the monitor's records, and what reached Lightning's CSV logger
    rows: dict[int, dict[str, float]] = {}
    (path,) = glob.glob(str(tmp_path / "lightning_logs" / "*" / "metrics.csv"))
    with open(path) as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if k.startswith("hookscope/") and v != ""}
            if vals:
                rows.setdefault(int(row["step"]), {}).update(vals)
    assert sorted(rows) == [0, 1]
    for step, rec in enumerate(want):
        _assert_same(cb.records[step].scalars(), rec, rel)
        _assert_same(rows[step], rec, max(rel, 1e-6))  # the CSV has ~7 significant digits


# -- Hugging Face Trainer -----------------------------------------------------------------------


def _hf_trainer(tmp_path, base, seen, report_to, fp16=False, data=None, device="cpu", **kw):
    x, y = data if data is not None else _data(16)
    samples = [{"x": x[i], "labels": y[i]} for i in range(16)]
    return hf_trainer(
        str(tmp_path / "hf"),
        copy.deepcopy(base),
        seen,
        samples,
        report_to=report_to,
        use_cpu=device == "cpu",
        fp16=fp16,
        **kw,
    )


def _log_tracker():
    """A Trainer callback keeping every ``on_log`` with its step: it stands for any report_to
    integration."""
    from transformers import TrainerCallback

    class Tracker(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append({"step": state.global_step, **logs})

    return Tracker()


def _records_in(logs: list[dict]) -> list[dict]:
    """The ``hookscope/`` part of each log that holds one."""
    return [
        {k: v for k, v in d.items() if k.startswith("hookscope/")}
        for d in logs
        if any(k.startswith("hookscope/") for k in d)
    ]


def test_hf_trainer_callback_reaches_mlflow_through_report_to(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    mlflow = pytest.importorskip("mlflow")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:" + str(tmp_path / "mlruns"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hookscope")
    monkeypatch.setenv("HF_MLFLOW_LOG_ARTIFACTS", "0")
    from transformers.integrations import integration_utils as iu

    setup = iu.MLflowCallback.setup

    def synchronous_setup(self, *a, **k):  # HF logs asynchronously; read-back needs every write
        setup(self, *a, **k)
        self._async_log = False

    monkeypatch.setattr(iu.MLflowCallback, "setup", synchronous_setup)
    base, seen = mlp6(), []
    trainer = _hf_trainer(tmp_path, base, seen, ["mlflow"])
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    trainer.train()
    assert len(seen) == 4  # 2 optimizer steps of 2 micro-batches
    want = _hand_loop(copy.deepcopy(base), [seen[:2], seen[2:]])
    assert [r.step for r in cb.records] == [0, 1]
    for got, rec in zip(cb.records, want):
        _assert_same(got.scalars(), rec)
        assert got.params["net.0.weight"]["grad_norm"] > 0  # read before the Trainer zeroed them
    mlflow.flush_async_logging()  # HF's MLflowCallback logs metrics asynchronously
    mlflow.set_tracking_uri("file:" + str(tmp_path / "mlruns"))
    client = mlflow.MlflowClient()
    (exp,) = [e for e in client.search_experiments() if e.name == "hookscope"]
    (run,) = client.search_runs([exp.experiment_id])

    def history(key: str) -> dict[int, float]:
        # HF's MLflowCallback logs asynchronously: wait (up to 10 s) for both steps to land
        for _ in range(100):
            hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            if len(hist) >= 2:
                break
            time.sleep(0.1)
        return hist

    for rec in cb.records:  # equal to the hand loop's (above)
        for key, value in rec.scalars().items():
            hist = history(key)
            assert len(hist) == 2, key  # HF logs at its global step: 1, 2
            assert _close(hist[rec.step + 1], value, 1e-12), (key, hist, value)


def test_hf_callback_without_the_trainer_says_where_records_go(tmp_path):
    pytest.importorskip("transformers")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = mlp6(), []
    trainer = _hf_trainer(tmp_path, base, seen, "none")
    cb = HookscopeTrainerCallback(every=1, alerts="off")
    trainer.add_callback(cb)
    with pytest.warns(hs.HookscopeWarning, match="not to report_to"):
        trainer.train()
    assert len(cb.records) == 2


@pytest.mark.parametrize("console", [False, True])
@pytest.mark.parametrize("printer", ["ProgressCallback", "PrinterCallback"])
def test_hf_records_reach_on_log_but_not_the_console_unless_asked(
    tmp_path, capsys, printer, console
):
    pytest.importorskip("transformers")

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = mlp6(), []
    # disable_tqdm=False: the Trainer prints logs through ProgressCallback, else PrinterCallback
    trainer = _hf_trainer(tmp_path, base, seen, "none", disable_tqdm=printer == "PrinterCallback")
    assert any(type(c).__name__ == printer for c in trainer.callback_handler.callbacks)
    tracker = _log_tracker()
    trainer.add_callback(tracker)
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off", console=console)
    trainer.add_callback(cb)
    n_callbacks = len(trainer.callback_handler.callbacks)
    capsys.readouterr()
    trainer.train()
    out = "".join(capsys.readouterr())
    assert len(trainer.callback_handler.callbacks) == n_callbacks  # the printers are back
    # the Trainer's own loss is still logged at every step (logging_steps=1) and printed as
    # before; the records are printed only when asked
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]
    assert out.count("'loss'") == 2
    assert ("hookscope/" in out) == console
    # every other callback (report_to integrations among them) and log_history got each record
    want = [r.scalars() for r in cb.records]
    assert len(want) == 2
    got = _records_in(tracker.logs)
    assert got == want
    assert [d["step"] for d in tracker.logs if "hookscope/net.0/mean" in d] == [1, 2]
    hist = [h for h in trainer.state.log_history if "hookscope/net.0/mean" in h]
    assert [{k: h[k] for k in w} for h, w in zip(hist, want)] == want


def test_hf_log_history_false_keeps_records_out_of_the_saved_state_only(tmp_path):
    pytest.importorskip("transformers")

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = mlp6(), []
    trainer = _hf_trainer(tmp_path, base, seen, "none")
    tracker = _log_tracker()
    trainer.add_callback(tracker)
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off", log_history=False)
    trainer.add_callback(cb)
    trainer.train()
    want = [r.scalars() for r in cb.records]
    assert len(want) == 2
    # report_to integrations (any on_log) still get every record ...
    got = _records_in(tracker.logs)
    assert got == want
    # ... the history (saved in trainer_state.json) has none, and keeps the Trainer's own logs
    assert not any(k.startswith("hookscope/") for h in trainer.state.log_history for k in h)
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]


# -- Accelerate ---------------------------------------------------------------------------------


def _accelerate_run(acc, base: nn.Module, data, unwrap: bool = True, **monitor_kw) -> tuple:
    """Train a copy of ``base`` through ``acc`` on ``data`` (micro-batches of 4) under a Monitor
    stepped at each optimizer step (with the torch optimizer, or the accelerated one where
    ``unwrap`` is false): the records, the micro-batches as the model got them, the optimizer."""
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=4)
    net, opt, loader = acc.prepare(net, opt, loader)
    seen = []
    with hs.Monitor(net, alerts="off", **monitor_kw) as mon:
        for xb, yb in loader:
            with acc.accumulate(net):
                seen.append((xb, yb))
                acc.backward(F.cross_entropy(net(xb), yb))
                opt.step()
                if acc.sync_gradients:
                    mon.step(opt.optimizer if unwrap else opt)
                opt.zero_grad()
        return list(mon.records), seen, opt


def test_accelerate_accumulate_one_record_per_optimizer_step():
    accelerate = pytest.importorskip("accelerate")
    base = mlp6()
    x, y = _data(16)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    got, seen, _ = _accelerate_run(acc, base, (x, y))
    want = _hand_loop(copy.deepcopy(base), [seen[:2], seen[2:]])
    assert [r.step for r in got] == [0, 1]
    for g, w in zip(got, want):
        _assert_same(g.scalars(), w)


# -- fp16 with a GradScaler: unscaled records, and a step the scaler skips ------------------------
#
# On the CPU, Lightning takes fp16 through its MixedPrecision plugin with a CPU GradScaler. Accelerate
# (and the HF Trainer on it) turn fp16 off on the CPU without a word (Accelerator(cpu=True,
# mixed_precision="fp16") has scaler=None and no autocast: plain fp32), so the CPU tests give the
# Accelerator the CPU GradScaler and autocast it would build on a GPU (its own fp16 code path then
# runs as on CUDA); the CUDA variants use the real flags and run where a GPU is.

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 flags need CUDA")
_DEVICES = ["cpu", pytest.param("cuda", marks=_cuda)]


def _net16() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _data16() -> tuple[torch.Tensor, torch.Tensor]:
    """16 samples; the third micro-batch of 4 (the first of optimizer step 1) is 1000x larger: its
    forward stays finite in fp16, its scaled backward overflows, so the scaler skips step 1."""
    x, y = _data(16)
    x[8:12] *= 1e3
    return x, y


def _hand_loop_fp16(
    net: nn.Module, steps: list, init_scale: float, device: str = "cpu", norm: bool = False
) -> tuple[list[hs.MonitorRecord], list[dict[str, float]], list[float]]:
    """Monitor in a plain fp16 loop with a GradScaler; also each step's parameter gradient norms
    unscaled by hand (``p.grad.norm() / scale`` before ``scaler.step``) and the scale after it.
    ``norm``: measure the gradient norm as the HF Trainer does (``clip_grad_norm_(..., inf)``,
    which on an overflow multiplies every gradient by inf/inf = NaN)."""
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    hand, scales = [], []
    with hs.Monitor(net, scaler=scaler, alerts="off") as mon:
        for micro in steps:
            for x, y in micro:
                with torch.autocast(device, dtype=torch.float16):
                    loss = F.cross_entropy(net(x.to(device)), y.to(device))
                scaler.scale(loss / len(micro)).backward()
            s = scaler.get_scale()
            hand.append({n: p.grad.double().norm().item() / s for n, p in net.named_parameters()})
            if norm:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            mon.step(opt)
            opt.zero_grad()
        return list(mon.records), hand, scales


def _check_fp16(
    got: list[hs.MonitorRecord],
    base: nn.Module,
    seen: list,
    init_scale: float,
    device: str,
    norm: bool = False,
) -> None:
    """``got`` (a trainer's records, on ``seen`` micro-batches) equals the plain fp16 loop's."""
    want, hand, scales = _hand_loop_fp16(
        copy.deepcopy(base), [seen[:2], seen[2:]], init_scale, device, norm
    )
    assert init_scale != 1 and scales == [init_scale, init_scale / 2]  # step 1 was skipped
    assert [r.step for r in got] == [0, 1]
    assert [r.skipped for r in want] == [False, True]
    assert [r.skipped for r in got] == [False, True]
    for g, w in zip(got, want):
        _assert_same(g.scalars(), w, 1e-5)
    params = [{n.removeprefix("net."): d for n, d in r.params.items()} for r in got]
    # unscaled: step 0's gradient norms are the scaled .grad over the scale, by hand
    for n, v in hand[0].items():
        assert _close(params[0][n]["grad_norm"], v, 1e-6), n
    # the skipped step: the non-finite gradients are recorded as such (never as "no gradient"),
    # the weights did not move, and the scalars say it
    bad = sorted(n for n, v in hand[1].items() if not math.isfinite(v))
    got_bad = sorted(n for n, d in params[1].items() if not math.isfinite(d["grad_norm"]))
    assert bad and got_bad == (sorted(hand[1]) if norm else bad)
    assert all(d["update_ratio"] == 0.0 for d in params[1].values())
    assert [r.scalars()["hookscope/skipped"] for r in got] == [0.0, 1.0]


def _cpu_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


@pytest.mark.parametrize("device", _DEVICES)
def test_lightning_fp16_grad_scaler_records_unscaled_and_skipped_steps(device):
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins import MixedPrecision

    from hookscope.integrations.lightning import HookscopeCallback

    base, (x, y), seen = _net16(), _data16(), []

    cb = HookscopeCallback(every=1, alerts="off")
    if device == "cpu":
        # precision="16-mixed" on the CPU: Lightning warns "AMP with fp16 is not supported on
        # CPU. Using `precision='bf16-mixed'` instead."; its fp16 plugin runs there when given
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=_cpu_scaler())]}
    else:
        precision = {"precision": "16-mixed"}
    trainer = _lightning_trainer(cb, accelerator=device, **precision)
    scaler = trainer.precision_plugin.scaler
    init = scaler.get_scale()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer.fit(_lightning_module(base, seen), loader)
    assert cb.monitor is not None and cb.monitor.scaler is scaler
    assert len(seen) == 4
    _check_fp16(cb.records, base, seen, init, device)


def test_hf_fp16_on_the_cpu_without_a_scaler_warns_that_the_run_is_fp32(tmp_path):
    pytest.importorskip("transformers")
    from hookscope.core._errors import HookscopeWarning
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = mlp6(), []
    trainer = _hf_trainer(tmp_path, base, seen, "none", fp16=True)
    assert trainer.accelerator.scaler is None  # what Accelerate does with fp16 on the CPU
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    with pytest.warns(HookscopeWarning, match=r"fp16=True.*no GradScaler.*bf16=True"):
        trainer.train()
    assert len(cb.records) == 2 and not any(r.skipped for r in cb.records)


def _cpu_fp16(accelerator) -> None:
    """Give a CPU Accelerator (which turned fp16 off) the GradScaler and autocast of its fp16 path."""
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None  # what it does
    accelerator.scaler = _cpu_scaler()
    accelerator.native_amp = True


@pytest.mark.parametrize("device", _DEVICES)
def test_hf_trainer_fp16_grad_scaler_records_unscaled_and_skipped_steps(tmp_path, device):
    pytest.importorskip("transformers")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = _net16(), []
    trainer = _hf_trainer(
        tmp_path,
        base,
        seen,
        "none",
        fp16=True,
        data=_data16(),
        device=device,
        train_sampling_strategy="sequential",  # the large micro-batch third
    )
    if device == "cpu":
        _cpu_fp16(trainer.accelerator)
    init = trainer.accelerator.scaler.get_scale()
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    trainer.train()
    assert cb.monitor is not None and cb.monitor.scaler is trainer.accelerator.scaler
    assert len(seen) == 4
    # the Trainer measures the gradient norm (clip_grad_norm_ with max_norm=inf) before the step:
    # on the overflow step that turns every gradient into NaN; the record says what .grad holds
    _check_fp16(cb.records, base, seen, init, device, norm=True)


@pytest.mark.parametrize("device", _DEVICES)
def test_accelerate_fp16_grad_scaler_records_unscaled_and_skipped_steps(device):
    accelerate = pytest.importorskip("accelerate")
    base, (x, y) = _net16(), _data16()
    acc = accelerate.Accelerator(
        cpu=device == "cpu", mixed_precision="fp16", gradient_accumulation_steps=2
    )
    if device == "cpu":
        _cpu_fp16(acc)
    init = acc.scaler.get_scale()
    got, seen, opt = _accelerate_run(acc, base, (x, y), scaler=acc.scaler)
    assert opt.step_was_skipped  # Accelerate's own word on the last step (step 1)
    _check_fp16(got, base, seen, init, device)


def _accelerate_fp16_records(pass_scaler: bool, unwrap: bool) -> list:
    accelerate = pytest.importorskip("accelerate")
    base, (x, y) = _net16(), _data16()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2)
    _cpu_fp16(acc)
    kw = {"scaler": acc.scaler} if pass_scaler else {}
    return _accelerate_run(acc, base, (x, y), unwrap=unwrap, **kw)[0]


def test_monitor_reads_through_an_accelerated_optimizer_and_adopts_its_scaler():
    """``mon.step(accelerated_optimizer)`` equals ``mon.step(torch_optimizer)``; a Monitor not
    given the Accelerator's GradScaler warns at the first step (whose output gradients are still
    scaled: the warning says so) and records the later steps as if it had been given it."""
    want = _accelerate_fp16_records(pass_scaler=True, unwrap=True)
    assert [r.skipped for r in want] == [False, True]  # _data16: the scaler skips step 1
    wrapped = _accelerate_fp16_records(pass_scaler=True, unwrap=False)
    assert [r.skipped for r in wrapped] == [False, True]
    for got, w in zip(wrapped, want, strict=True):
        _assert_same(got.scalars(), w, rel=0)
    with pytest.warns(hs.MonitorWarning, match=r"step 0: .*GradScaler the Monitor was not given"):
        late = _accelerate_fp16_records(pass_scaler=False, unwrap=False)
    assert [r.skipped for r in late] == [False, True]
    _assert_same(late[1].scalars(), want[1], rel=0)
    # the first step: parameter gradients (unscaled by scaler.step) agree; output gradients are
    # the scaled ones, as the warning said
    p0, w0 = late[0].scalars(), want[0].scalars()
    pk = [k for k in w0 if "/params/" in k and k.endswith("grad_norm")]
    assert pk and all(p0[k] == w0[k] for k in pk)
    gk = [k for k in w0 if k.endswith("/grad_norm") and "/params/" not in k]
    assert gk and any(p0[k] != w0[k] for k in gk)


@pytest.mark.parametrize("order", ["before_scaler_step", "after_update"])
def test_plain_loop_records_the_step_a_grad_scaler_skips(order):
    """What the trainer tests above compare against: in a plain loop, ``record.skipped`` says
    whether the scaler skipped the step, whenever ``step()`` is called; ``None`` without one."""
    x, y = _data16()
    net = _net16()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    got, skipped_by_scaler = [], []
    with hs.Monitor(net, scaler=scaler, alerts="off", sentinel=True) as mon:
        for i in range(0, 16, 8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(net(x[i : i + 8]), y[i : i + 8])
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            if order == "before_scaler_step":
                got.append(mon.step(opt))
            scaler.step(opt)
            scaler.update()
            skipped_by_scaler.append(scaler.get_scale() < before)
            if order == "after_update":
                got.append(mon.step(opt))
            opt.zero_grad()
    assert skipped_by_scaler == [False, True]
    assert [r.skipped for r in got] == [False, True]
    assert [r.to_dict()["skipped"] for r in got] == [False, True]
    # an overflow the scaler handles is not a NaN/Inf origin for the sentinel
    assert [r.nonfinite for r in got] == [None, None] and mon.nonfinite is None
    assert not all(math.isfinite(d["grad_norm"]) for d in got[1].params.values())
    with hs.Monitor(_net16(), alerts="off") as mon:
        F.cross_entropy(mon.model(x), y).backward()
        assert mon.step().skipped is None
        assert "hookscope/skipped" not in mon.records[-1].scalars()


def test_a_nan_parameter_gradient_is_reported_as_nan_not_as_missing():
    net = _net16()
    x, y = _data(8)
    with hs.Monitor(net, alerts="off") as mon:
        F.cross_entropy(net(x), y).backward()
        net[2].weight.grad[0, 0] = math.nan
        net[4].bias.grad = None
        rec = mon.step()
    assert math.isnan(rec.params["2.weight"]["grad_norm"])
    assert "grad_norm" not in rec.params["4.bias"]  # no gradient: no value, never a fake one
    assert _close(rec.params["0.weight"]["grad_norm"], net[0].weight.grad.norm().item(), 1e-6)


# -- the sentinel through the trainers -------------------------------------------------------


@contextmanager
def _nonfinite_warnings() -> Iterator[list[str]]:
    """The messages of the NonFiniteWarnings raised inside (the other monitor alerts, such as the
    layer's non-finite output count, are let through unchecked)."""
    out: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield out
    out += [str(w.message) for w in caught if issubclass(w.category, hs.NonFiniteWarning)]


class _Boom(nn.Module):
    """Identity, except on its ``at``-th call (0-based): there it takes the log of its input, a
    NaN wherever the input is negative (a real op, so the backward has NaN too)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.log() if self.calls - 1 == self.at else x * 1.0


def _boom_net(at: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), _Boom(at), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _sentinel_reference(base: nn.Module, steps: list) -> tuple[list, hs.NonFiniteOrigin]:
    """A plain loop with ``Monitor(sentinel=True)``, and ``find_nonfinite`` run on a copy of the
    model just before the micro-batch that makes the NaN (the 3rd: step 1's first)."""
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    found = None
    with (
        _nonfinite_warnings() as warned,
        hs.Monitor(net, every=1, alerts="warn", sentinel=True) as mon,
    ):
        for micro in steps:
            for x, y in micro:
                if net[2].calls == net[2].at:
                    probe = copy.deepcopy(net)
                    found = hs.find_nonfinite(
                        probe, x, loss_fn=lambda out, y=y: F.cross_entropy(out, y)
                    )
                (F.cross_entropy(net(x), y) / len(micro)).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        recs = list(mon.records)
    assert len(warned) == 1 and re.match(r"step 1: NAN .* layer '2' \(_Boom\)", warned[0])
    assert found is not None
    return recs, found


def _check_sentinel(records: list[hs.MonitorRecord], first, want: list, found) -> None:
    def strip(o: hs.NonFiniteOrigin | None) -> tuple | None:
        if o is None:
            return None
        return (o.layer.removeprefix("net."), o.phase, o.call, o.kind, o.module_type, o.stats)

    assert [strip(r.nonfinite) for r in records] == [None, strip(want[1].nonfinite)]
    assert strip(records[1].nonfinite)[:5] == ("2", "forward", 0, "nan", "_Boom")
    assert strip(first) == strip(want[1].nonfinite)
    assert (found.layer, found.phase, found.kind) == ("2", "forward", "nan")
    assert _close(found.stats["output_absmax"], want[1].nonfinite.stats["output_absmax"])


def test_lightning_callback_sentinel_names_the_nan_layer_and_step():
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    base, (x, y), seen = _boom_net(at=2), _data(16), []

    cb = HookscopeCallback(every=1, alerts="warn", sentinel=True)
    trainer = _lightning_trainer(cb)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    # the NaN loss does not stop the run; the origin is reported as a warning at the step
    with _nonfinite_warnings() as warned:
        trainer.fit(_lightning_module(base, seen), loader)
    assert len(warned) == 1 and re.match(r"step 1: NAN .* layer 'net\.2' \(_Boom\)", warned[0])
    assert len(seen) == 4 and trainer.global_step == 2
    want, found = _sentinel_reference(base, [seen[:2], seen[2:]])
    _check_sentinel(cb.records, cb.monitor.nonfinite, want, found)


def test_hf_trainer_callback_sentinel_names_the_nan_layer_and_step(tmp_path):
    pytest.importorskip("transformers")
    from hookscope.integrations.transformers import HookscopeTrainerCallback

    base, seen = _boom_net(at=2), []
    trainer = _hf_trainer(tmp_path, base, seen, "none")
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="warn", sentinel=True)
    trainer.add_callback(cb)
    with _nonfinite_warnings() as warned:  # the NaN loss does not stop the run
        trainer.train()
    assert len(warned) == 1 and re.match(r"step 1: NAN .* layer 'net\.2' \(_Boom\)", warned[0])
    assert len(seen) == 4 and trainer.state.global_step == 2
    want, found = _sentinel_reference(base, [seen[:2], seen[2:]])
    _check_sentinel(cb.records, cb.monitor.nonfinite, want, found)
    # the record also reached trainer.log (so every report_to integration) with its NaN values
    logged = [h for h in trainer.state.log_history if "hookscope/net.2/nonfinite" in h]
    assert [h["hookscope/net.2/nonfinite"] > 0 for h in logged] == [False, True]


# -- W&B and MLflow sinks in a plain loop -------------------------------------------------------


def _wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline W&B run, read from its ``.wandb`` file (a LevelDB-style log of
    protobuf records: 7-byte file header; 32 KiB blocks of records with 7-byte headers). The
    W&B service may still be writing it after ``run.finish()`` returns: read until the run's
    ``exit`` record is there."""
    import time

    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    for _ in range(100):
        with open(path, "rb") as f:
            data = f.read()
        pos, buf, rows, kinds, block = 7, b"", [], [], 32768
        while pos + 7 <= len(data):
            left = block - pos % block
            n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            if left < 7 or kind == 0:  # padding to the end of the block
                pos += left
                continue
            if pos + 7 + n > len(data):  # the service is still writing this record
                break
            buf += data[pos + 7 : pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):  # a full record, or the last fragment of one
                rec = pb.Record()
                try:
                    rec.ParseFromString(buf)
                except DecodeError:  # a record caught half-written: read the file again
                    kinds.append("partial")
                    break
                buf = b""
                kinds.append(rec.WhichOneof("record_type"))
                if kinds[-1] == "history":
                    rows.append(
                        {
                            (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item
                        }
                    )
        if "exit" in kinds and "partial" not in kinds:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"the W&B run file has no exit record: {kinds}")


def test_wandb_sink_offline_run_holds_the_monitor_values(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    x, y = _data(16)
    steps = [[(x[:8], y[:8])], [(x[8:], y[8:])]]
    run = wandb.init(dir=str(tmp_path), project="hookscope-test")
    try:
        net = mlp6()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with hs.Monitor(net, alerts="off", sinks=[hs.WandbSink(run)]) as mon:
            for micro in steps:
                for xb, yb in micro:
                    F.cross_entropy(net(xb), yb).backward()
                opt.step()
                mon.step(opt)
                opt.zero_grad()
            recs = list(mon.records)
    finally:
        run.finish()
    rows = [r for r in _wandb_history(str(tmp_path)) if any(k.startswith("hookscope/") for k in r)]
    assert [r["_step"] for r in rows] == [0, 1]
    for row, rec in zip(rows, recs):
        _assert_same({k: v for k, v in row.items() if k.startswith("hookscope/")}, rec, 1e-12)


def test_mlflow_sink_file_store_holds_the_monitor_values(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri("file:" + str(tmp_path / "mlruns"))
    mlflow.set_experiment("sink")
    x, y = _data(8)
    net = mlp6()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with mlflow.start_run() as run, hs.Monitor(net, alerts="off", sinks=[hs.MlflowSink()]) as mon:
        for _ in range(2):
            F.cross_entropy(net(x), y).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        recs = list(mon.records)
    client = mlflow.MlflowClient()
    assert [r.step for r in recs] == [0, 1]
    keys = set(recs[0].scalars())
    assert keys == set(recs[1].scalars()) and len(keys) >= 10
    assert set(client.get_run(run.info.run_id).data.metrics) == keys  # nothing missing or extra
    compared = 0
    for rec in recs:
        for key, value in rec.scalars().items():
            hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            assert sorted(hist) == [0, 1], key
            assert _close(hist[rec.step], value, 1e-12), key
            compared += 1
    assert compared == 2 * len(keys)


def test_sinks_need_an_active_run(monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    import mlflow
    import wandb

    # no run, whatever another test or the environment left active
    monkeypatch.setattr(wandb, "run", None)
    monkeypatch.setattr(mlflow, "active_run", lambda: None)
    with pytest.raises(ValueError, match="wandb.init"):
        hs.WandbSink()
    with pytest.raises(ValueError, match="mlflow.start_run"):
        hs.MlflowSink()


# -- extras ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "host", "extra"),
    [
        ("hookscope.integrations.lightning", "lightning.pytorch", "lightning"),
        ("hookscope.integrations.transformers", "transformers", "transformers"),
    ],
)
def test_a_missing_extra_names_the_pip_install(monkeypatch, module, host, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, host, None)  # "not installed"
    with pytest.raises(ImportError, match=rf"pip install 'hookscope\[{extra}\]'"):
        importlib.import_module(module)
