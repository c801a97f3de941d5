"""Cost of hookscope's trainer callbacks: a whole ``Trainer.fit`` (Lightning) and
``Trainer.train`` (Hugging Face), bare against the callback logging every 10 optimizer steps and
every step, beside the same training in a plain loop with ``hs.Monitor`` (the monitor's own cost
on the same model, for comparison). Whole runs are interleaved (bare, every 10, every step,
rotated each round) so machine noise hits each alike; ratios are medians over rounds of
(run / bare run of the same round), in wall time and in process CPU time (steadier on a shared
machine).

    .venv/bin/python benchmarks/bench_trainers.py [--steps 100] [--rounds 5]
    # the workload of the monitor's own goal (resnet18, 224x224, batch 16):
    .venv/bin/python benchmarks/bench_trainers.py --model resnet18 --size 224 --batch 16 \
        --steps 8 --rounds 3 --kinds bare,every-step
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL = "demonet"
BATCH = 32
CLASSES = 4


def _mlp() -> nn.Module:
    """The benchmarked network (``--model``), seeded."""
    torch.manual_seed(0)
    if MODEL == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=CLASSES)
    from hookscope import DemoNet

    return DemoNet()


def loop_run(steps: int, every: int | None, data) -> None:
    """The same training as a plain loop: ``hs.Monitor`` stepped after ``optimizer.step()``."""
    import hookscope as hs

    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    mon = hs.Monitor(net, every=every, alerts="off") if every else None
    for x, y in torch.utils.data.DataLoader(data, batch_size=BATCH):
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if mon is not None:
            mon.step(opt)
        opt.zero_grad()
    if mon is not None:
        mon.close()


def lightning_run(steps: int, every: int | None, data) -> None:
    import lightning as L

    from hookscope.integrations.lightning import HookscopeCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cbs = [HookscopeCallback(every=every, alerts="off")] if every else []
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=cbs,
        logger=False,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH))


class _HFModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels):
        return {"loss": F.cross_entropy(self.net(x), labels)}


def hf_run(steps: int, every: int | None, data, out: str) -> None:
    from transformers import Trainer, TrainingArguments

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=0.01,
        optim="sgd",
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
        log_level="error",
    )
    ds = [{"x": x, "labels": y} for x, y in data]
    trainer = Trainer(model=_HFModel(), args=args, train_dataset=ds)
    if every:
        trainer.add_callback(HookscopeTrainerCallback(None, every=every, alerts="off"))
    trainer.train()


def main() -> None:
    global MODEL, BATCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=["demonet", "resnet18"], default="demonet")
    ap.add_argument("--size", type=int, default=64, help="picture side")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--trainers", default="lightning,hf,loop", help="lightning,hf,loop")
    ap.add_argument("--kinds", default="bare,every-10,every-step")
    args = ap.parse_args()
    MODEL, BATCH = args.model, args.batch
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 3, args.size, args.size, generator=g),
        torch.randint(0, CLASSES, (n,), generator=g),
    )
    out = tempfile.mkdtemp()
    every = {"bare": None, "every-10": 10, "every-step": 1}
    names = args.kinds.split(",")
    if names[0] != "bare" or any(k not in every for k in names):
        ap.error(f"--kinds: 'bare' first, then any of {list(every)[1:]}")
    runs = {
        "lightning": ("Lightning Trainer.fit", lambda e: lightning_run(args.steps, e, data)),
        "hf": ("HF Trainer.train", lambda e: hf_run(args.steps, e, data, out)),
        "loop": ("plain loop + hs.Monitor", lambda e: loop_run(args.steps, e, data)),
    }
    for key in args.trainers.split(","):
        name, run = runs[key]
        run(None)  # warm-up (imports, first-call costs)
        wall: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        for r in range(args.rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                t0, c0 = time.perf_counter(), time.process_time()
                run(every[k])
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        print(
            f"{name}: {args.model}, batch {args.batch} of {args.size}x{args.size}, "
            f"{args.steps} steps, {args.threads} thread(s), {args.rounds} rounds interleaved, "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}"
        )
        print("| run | wall s / run (median) | wall ratio to bare | CPU ratio to bare |")
        print("|---|---:|---:|---:|")
        for k in names:
            rw = statistics.median(a / b for a, b in zip(wall[k], wall["bare"]))
            rc = statistics.median(a / b for a, b in zip(cpu[k], cpu["bare"]))
            print(f"| {k} | {statistics.median(wall[k]):.3f} | {rw:.3f}× | {rc:.3f}× |")
        print(flush=True)


if __name__ == "__main__":
    main()
