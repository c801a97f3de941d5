"""The trainer callbacks on every rank: Lightning ``strategy="ddp"``, Lightning's
``ModelParallelStrategy`` with FSDP2 (``fully_shard``), and the Hugging Face Trainer under DDP
(gloo, 2 CPU processes on loopback, started by ``_dist.launch`` with the environment variables a
launcher like torchrun sets, so the trainers start no processes of their own), with gradient
accumulation. What reaches the run's own logger on rank 0 equals a one-process hand-written loop
(``Monitor``) on the same weights and the combined micro-batches of both ranks; no other rank
writes.

Not here: the HF Trainer's FSDP2 (``fsdp_config={"fsdp_version": 2}``). Accelerate 1.15 turns
FSDP on only for GPU-like devices (``AcceleratorState``: the ``MULTI_GPU``, ``MULTI_XPU``, ...
branch); on CPU it keeps ``MULTI_CPU`` and the Trainer wraps the model in DDP instead (checked:
``trainer.model_wrapped`` is ``DistributedDataParallel`` with plain parameters), so a CPU test
would test DDP twice."""

from __future__ import annotations

import csv
import glob
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from helpers.common import mlp6
from helpers.dist import WORLD, assert_records_close, launch
from helpers.trainers import hf_trainer

pytestmark = pytest.mark.filterwarnings(
    # the trainers' own notices, not ours to fix
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
    "ignore::ResourceWarning",
)

BATCH = 4  # per rank and micro-batch
ACCUM = 2  # micro-batches per optimizer step
STEPS = 2
N = WORLD * BATCH * ACCUM * STEPS  # every sample used once


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _torchrun_env(rank: int) -> None:
    """What torchrun sets (MASTER_ADDR/PORT: set by ``_dist.launch``)."""
    os.environ.update(
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(WORLD),
        GROUP_RANK="0",
    )


class _Holder(nn.Module):
    """The reference model: the network as ``.net``, named as in the trainers' modules."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _reference(steps: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[dict]:
    """One process, a plain loop: each step a list of micro-batches, loss divided by their count."""
    net = _Holder(mlp6())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, alerts="off") as mon:
        for micro in steps:
            for x, y in micro:
                (F.cross_entropy(net(x), y) / len(micro)).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        return [r.to_dict() for r in mon.records]


def _unflatten(step: int, scalars: dict[str, float], prefix: str = "hookscope") -> dict:
    """``MonitorRecord.scalars()`` (as a logger got them) back into ``to_dict()``'s layout."""
    rec: dict = {"step": step, "layers": {}, "params": {}}
    for key, v in scalars.items():
        head, _, stat = key.removeprefix(prefix + "/").rpartition("/")
        group, name = ("params", head[7:]) if head.startswith("params/") else ("layers", head)
        rec[group].setdefault(name, {})[stat] = float(v)
    return rec


# -- Lightning: DDP and FSDP2 ------------------------------------------------------------------


def _lightning_worker(rank: int, tmp: str, strategy_name: str) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger, Logger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from hookscope.integrations.lightning import HookscopeCallback

    _torchrun_env(rank)
    os.environ["PL_GLOBAL_SEED"] = "0"  # the sampler's seed (a seed_everything elsewhere sets it)
    seen: list[torch.Tensor] = []
    calls: list[int] = []

    class Spy(Logger):  # not rank-zero-only: records what the callback sends on this rank
        name, version = "spy", 0

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("hookscope/") for k in metrics):
                calls.append(step)

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp6()

        def configure_model(self):  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            if strategy_name == "fsdp2":
                mesh = self.device_mesh["data_parallel"]
                for i in (0, 2, 4):
                    fully_shard(self.net[i], mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, i):
            seen.append(batch[2].clone())
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = _data()
    data = torch.utils.data.TensorDataset(x, y, torch.arange(N))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)  # Lightning adds the sampler
    cb = HookscopeCallback(every=1, alerts="off")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        num_nodes=1,
        strategy=(
            "ddp"
            if strategy_name == "ddp"
            else ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
        ),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        callbacks=[cb],
        logger=[CSVLogger(tmp), Spy()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Module(), loader)
    sharded = isinstance(cb.monitor.model.net[0].weight, torch.distributed.tensor.DTensor)
    torch.save(
        {
            "seen": seen,
            "calls": calls,
            "records": [r.to_dict() for r in cb.records],
            "sharded": sharded,
        },
        os.path.join(tmp, f"rank{rank}.pt"),
    )


def _read_csv(tmp: str) -> list[dict]:
    rows: dict[int, dict[str, float]] = {}
    (path,) = glob.glob(os.path.join(tmp, "lightning_logs", "*", "metrics.csv"))
    with open(path) as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if k.startswith("hookscope/") and v != ""}
            if vals:
                rows.setdefault(int(row["step"]), {}).update(vals)
    return [_unflatten(step, rows[step]) for step in sorted(rows)]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_rank0_logs_the_combined_batch_statistics(tmp_path, strategy):
    """``strategy="ddp"``, and ``ModelParallelStrategy`` sharding the module with FSDP2's
    ``fully_shard`` (the monitor then reads DTensor parameters)."""
    pytest.importorskip("lightning")
    launch(_lightning_worker, str(tmp_path), strategy, timeout=120)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [o["sharded"] for o in out] == [strategy == "fsdp2"] * WORLD
    # Lightning trains on a DistributedSampler(shuffle=True, seed=0): one permutation of the
    # samples (its generator seeded with seed + epoch), and rank r takes every WORLD-th from r
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    for r in range(WORLD):
        want = order[r::WORLD].split(BATCH)
        assert [s.tolist() for s in out[r]["seen"]] == [w.tolist() for w in want]
    x, y = _data()
    # optimizer step s, micro-batch m: both ranks' micro-batch (s * ACCUM + m), as one batch
    steps = [
        [
            (x[idx], y[idx])
            for idx in (
                torch.cat([out[r]["seen"][s * ACCUM + m] for r in range(WORLD)])
                for m in range(ACCUM)
            )
        ]
        for s in range(STEPS)
    ]
    ref = _reference(steps)
    assert_records_close(_read_csv(str(tmp_path)), ref, STEPS)  # what Lightning's logger wrote
    for r in range(WORLD):  # every rank records the reduced statistics ...
        assert_records_close(out[r]["records"], ref, STEPS)
    assert out[0]["calls"] == list(range(STEPS))  # ... and only rank 0 sends them to the loggers
    assert out[1]["calls"] == []


# -- Hugging Face Trainer under DDP -------------------------------------------------------------


def _hf_trainer(out: str, seen: list, **kw):
    """An HF Trainer on ``_data()``: ACCUM micro-batches of BATCH per rank, STEPS optimizer
    steps; each sample carries its index, which the model notes in ``seen``."""
    x, y = _data()
    samples = [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(N)]
    return hf_trainer(
        out,
        mlp6(),
        seen,
        samples,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        **kw,
    )


def _hf_worker(rank: int, tmp: str) -> None:
    from transformers import TrainerCallback

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    _torchrun_env(rank)
    seen: list[torch.Tensor] = []
    got: list[tuple[int, dict]] = []
    loss_logs: list[tuple[int, float]] = []

    class Collect(TrainerCallback):  # what report_to integrations get, on every rank
        def on_log(self, args, state, control, logs=None, **kw):
            ours = {k: v for k, v in logs.items() if k.startswith("hookscope/")}
            if ours:
                got.append((state.global_step, ours))
            if "loss" in logs:
                loss_logs.append((state.global_step, logs["loss"]))

    trainer = _hf_trainer(os.path.join(tmp, "hf"), seen, ddp_backend="gloo")
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    trainer.add_callback(Collect())
    trainer.train()
    torch.save(
        {
            "seen": seen,
            "logs": got,
            "loss_logs": loss_logs,
            "records": [r.to_dict() for r in cb.records],
            "ddp": type(trainer.model_wrapped).__name__,
        },
        os.path.join(tmp, f"rank{rank}.pt"),
    )


@pytest.mark.distributed
def test_hf_trainer_ddp_rank0_logs_the_combined_batch_statistics(tmp_path):
    pytest.importorskip("transformers")
    launch(_hf_worker, str(tmp_path), timeout=120)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [o["ddp"] for o in out] == ["DistributedDataParallel"] * WORLD
    # each rank's micro-batches as its model got them (the Trainer's seeded sampler, sharded)
    seen = [[s.view(-1) for s in o["seen"]] for o in out]
    assert sorted(torch.cat([torch.cat(s) for s in seen]).tolist()) == list(range(N))
    x, y = _data()
    steps = [
        [
            (x[idx], y[idx])
            for idx in (
                torch.cat([seen[r][s * ACCUM + m] for r in range(WORLD)]) for m in range(ACCUM)
            )
        ]
        for s in range(STEPS)
    ]
    ref = _reference(steps)
    # what the report_to integrations got (on_log), at the Trainer's global step 1, 2, ...
    logged = [_unflatten(step - 1, logs) for step, logs in out[0]["logs"]]
    assert_records_close(logged, ref, STEPS)
    assert out[1]["logs"] == []  # only rank 0 logs
    for r in range(WORLD):  # every rank records the reduced statistics
        assert_records_close(out[r]["records"], ref, STEPS)
    for r in range(WORLD):  # the Trainer's own loss log is kept at every step, on every rank
        assert [s for s, _ in out[r]["loss_logs"]] == list(range(1, STEPS + 1))


def test_hf_trainer_keeps_its_own_loss_log_beside_the_records(tmp_path):
    """trainer.log (how records reach report_to) clears control.should_log; the callback keeps
    the Trainer's own log of the step: the same as a run without the callback."""
    pytest.importorskip("transformers")

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    def own_logs(callback: bool) -> list[dict]:
        trainer = _hf_trainer(str(tmp_path / f"hf{callback}"), [])
        if callback:
            trainer.add_callback(HookscopeTrainerCallback(trainer, every=1, alerts="off"))
        trainer.train()
        drop = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
        return [
            {k: v for k, v in h.items() if not k.startswith("hookscope/") and k not in drop}
            for h in trainer.state.log_history
            if not all(k.startswith("hookscope/") or k in ("epoch", "step") for k in h)
        ]

    bare, watched = own_logs(False), own_logs(True)
    assert [h["step"] for h in bare if "loss" in h] == list(range(1, STEPS + 1))
    assert watched == bare
