"""The Hugging Face Trainer as the trainer tests run it: a small net behind the Trainer's
``forward(x, labels)`` that notes what each micro-batch was, and plain-SGD training arguments
whose steps a hand-written loop can repeat."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HFModel", "hf_trainer"]


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
