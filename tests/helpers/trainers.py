"""The Hugging Face Trainer as the trainer tests run it: a small net behind the Trainer's
``forward(x, labels)`` that notes what each micro-batch was, and plain-SGD training arguments
whose steps a hand-written loop can repeat; and what the trainer tests share besides: the
third-party warnings they ignore, a reset of accelerate's process-wide state after each test, and
a small classifier with its data."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "NOISE",
    "HFModel",
    "base",
    "data",
    "fresh_accelerate_state",
    "hf_trainer",
    "lightning_module",
]


class HFModel(nn.Module):
    """``net`` as the HF Trainer calls it (a dict with the cross-entropy loss). Each forward
    appends to ``seen`` what it got: the samples' ``idx`` where the dataset carries one (ranks
    share it out), else copies of ``(x, labels)``."""

    def __init__(self, net: nn.Module, seen: list) -> None:
        super().__init__()
        self.net, self._seen = net, seen

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if idx is None:
            self._seen.append((x.detach().clone(), labels.detach().clone()))
        else:
            self._seen.append(idx.clone())
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def hf_trainer(
    out: str, net: nn.Module, seen: list, samples: list[dict], **kw: Any
) -> Any:  # transformers.Trainer (imported only here)
    """A Trainer of :class:`HFModel` on ``samples``: micro-batches of 4, 2 per optimizer step,
    2 steps of plain SGD (rate 0.1, constant, no decay, no clipping), a log each step, on the
    CPU, reporting to nothing; ``kw`` overrides any ``TrainingArguments``."""
    from transformers import Trainer, TrainingArguments

    args = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 2,
        "learning_rate": 0.1,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    args = TrainingArguments(output_dir=out, **{**args, **kw})
    return Trainer(model=HFModel(net, seen), args=args, train_dataset=samples)


# third-party noise of the trainers (not ours to fix), for pytest.mark.filterwarnings
NOISE = (
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning:lightning.*",
    "ignore::UserWarning:transformers.*",
    "ignore::UserWarning:accelerate.*",
    "ignore::pytest.PytestUnraisableExceptionWarning",
    "ignore::ResourceWarning",
)


def fresh_accelerate_state() -> Iterator[None]:
    """After a test, accelerate's singletons reset (a test's Accelerator must not leak its
    gradient-accumulation settings into the next); use as an autouse fixture."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


def base() -> nn.Module:
    """A 6-8-3 classifier, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 16, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs for :func:`base` (times ``scale``) and their classes, seeded."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * scale, torch.randint(0, 3, (n,), generator=g)


def lightning_module(base: nn.Module, seen: list, validation: bool = True):
    """A LightningModule training a copy of ``base``, noting each micro-batch in ``seen``; with
    ``validation``, a validation step whose forward would change the statistics if recorded."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(base)

        def training_step(self, batch, i):
            seen.append((batch[0].clone(), batch[1].clone()))
            return F.cross_entropy(self.net(batch[0]), batch[1])  # a sub-module, not self(...)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Validated(Module):
        def validation_step(self, batch, i):
            self.net(batch[0] * 100)  # would change the statistics if it were recorded

    return Validated() if validation else Module()
