"""Cost of hookscope's trainer callbacks: a whole ``Trainer.fit`` (Lightning) and
``Trainer.train`` (Hugging Face) on hookscope's small demo CNN (64×64 pictures, batch 32), bare against the callback logging every 10
optimizer steps and every step. Whole runs are interleaved (bare, every 10, every step, rotated
each round) so machine noise hits each alike; ratios are medians over rounds of
(run / bare run of the same round).

    .venv/bin/python benchmarks/bench_trainers.py [--steps 60] [--rounds 5]
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


def _mlp() -> nn.Module:
    from hookscope import DemoNet

    torch.manual_seed(0)
    return DemoNet()


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
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=32))


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
        per_device_train_batch_size=32,
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    g = torch.Generator().manual_seed(0)
    n = 32 * args.steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 4, (n,), generator=g)
    )
    out = tempfile.mkdtemp()
    kinds = {"bare": None, "every 10": 10, "every step": 1}
    for name, run in (
        ("Lightning Trainer.fit", lambda e: lightning_run(args.steps, e, data)),
        ("HF Trainer.train", lambda e: hf_run(args.steps, e, data, out)),
    ):
        run(None)  # warm-up (imports, first-call costs)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        names = list(kinds)
        for r in range(args.rounds):
            for k in names[r % 3 :] + names[: r % 3]:
                t0 = time.perf_counter()
                run(kinds[k])
                times[k].append(time.perf_counter() - t0)
        print(
            f"{name}: DemoNet, batch 32 of 64x64, {args.steps} steps, {args.threads} thread(s), "
            f"{args.rounds} rounds interleaved, torch {torch.__version__}"
        )
        print("| run | s / run (median) | ratio to bare (median of rounds) |")
        print("|---|---:|---:|")
        for k in names:
            ratio = statistics.median(a / b for a, b in zip(times[k], times["bare"]))
            print(f"| {k} | {statistics.median(times[k]):.3f} | {ratio:.3f}× |")
        print()


if __name__ == "__main__":
    main()
