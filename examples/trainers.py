"""hookscope's Monitor inside the trainers people use, on the demo CNN and its shapes data set.

Each trainer trains DemoNet with gradient accumulation (2 micro-batches per optimizer step) and
logs hookscope's statistics every ``--every`` optimizer steps to the run's own logger. CPU, no
download:

    .venv/bin/python examples/trainers.py lightning    # Lightning's CSV logger: <out>/lightning/
    .venv/bin/python examples/trainers.py hf           # HF Trainer, report_to="none": log_history
    .venv/bin/python examples/trainers.py accelerate   # an Accelerate loop, a JSON Lines sink

Needs the extras: ``pip install 'hookscope[lightning]'``, ``[transformers]``, ``[accelerate]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hookscope as hs


def lightning_run(data: hs.DemoDataset, out: Path, steps: int, every: int) -> Path:
    """``Trainer.fit`` with ``HookscopeCallback``; returns the CSV logger's metrics file."""
    import lightning as L

    from hookscope.integrations.lightning import HookscopeCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = hs.DemoNet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    logger = L.pytorch.loggers.CSVLogger(out, name="lightning")
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
        callbacks=[HookscopeCallback(every=every)],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
    return Path(logger.log_dir) / "metrics.csv"


def hf_run(data: hs.DemoDataset, out: Path, steps: int, every: int) -> list[dict[str, float]]:
    """``Trainer.train`` with ``HookscopeTrainerCallback``; returns the hookscope logs."""
    from transformers import Trainer, TrainingArguments

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    class Model(torch.nn.Module):  # the HF Trainer wants a model that returns its loss
        def __init__(self) -> None:
            super().__init__()
            self.net = hs.DemoNet()

        def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            logits = self.net(pixel_values)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    rows = [{"pixel_values": x, "labels": y} for x, y in data]
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=0.0,  # no clipping: records hold the gradients backward gave (else a warning)
        logging_steps=every,
        report_to="none",  # or "tensorboard", "wandb", "mlflow": records reach them all
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=Model(), args=args, train_dataset=rows)
    trainer.add_callback(HookscopeTrainerCallback(trainer, every=every))
    trainer.train()
    return [h for h in trainer.state.log_history if any(k.startswith("hookscope/") for k in h)]


def accelerate_run(data: hs.DemoDataset, out: Path, steps: int, every: int) -> Path:
    """An Accelerate loop with ``accelerator.accumulate``; returns the JSON Lines file."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = hs.DemoNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    path = out / "accelerate.jsonl"
    sinks = [hs.JsonlSink(path)]
    with hs.Monitor(model, every=every, sinks=sinks, scaler=accelerator.scaler) as mon:
        done = 0
        while done < steps:
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(F.cross_entropy(model(x), y))
                    optimizer.step()
                    if accelerator.sync_gradients:  # an optimizer step, not a micro-batch
                        mon.step(optimizer)
                        done += 1
                    optimizer.zero_grad()
                if done == steps:
                    break
    return path


RUNS = {"lightning": lightning_run, "hf": hf_run, "accelerate": accelerate_run}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trainer", choices=sorted(RUNS))
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--every", type=int, default=5, help="log every N optimizer steps")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: a temp one)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out = args.out or Path(tempfile.mkdtemp(prefix="hookscope-"))
    got = RUNS[args.trainer](hs.make_demo_dataset(512), out, args.steps, args.every)
    if isinstance(got, list):
        for h in got:
            print(f"step {h['step']}: {len(h)} values, e.g. {_sample(h)}")
    else:
        print(f"wrote {got}")


def _sample(logs: dict[str, float]) -> str:
    key = next(k for k in logs if k.endswith("/grad_norm"))
    return f"{key} = {logs[key]:.4g}"


if __name__ == "__main__":
    main()
