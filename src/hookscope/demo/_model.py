"""hookscope's built-in demo model: a small CNN that tells circles, squares, triangles and crosses
apart, trained on :func:`make_demo_dataset` pictures. Its weights ship inside the package.

Regenerate the weights (deterministic, a few minutes on two CPU cores)::

    python -m hookscope.demo._model train            # writes src/hookscope/demo/demo_weights.pt
    python examples/train_demo_model.py        # the same
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._data import DEMO_CLASSES, IMAGE_SIZE, DemoDataset, make_demo_dataset

__all__ = ["DemoNet", "evaluate_demo_model", "load_demo_model", "train_demo_model"]

WEIGHTS_PATH = Path(__file__).with_name("demo_weights.pt")
_FORMAT = 1
# Seeds: training draws fresh data from TRAIN_SEED + epoch; tests and the report use TEST_SEED.
TRAIN_SEED = 1000
TEST_SEED = 7


def _conv(cin: int, cout: int) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class DemoNet(nn.Module):
    """Four stages: ``stage1`` (64×64 → 32×32), ``stage2`` (→ 16×16), ``stage3`` (16×16, the
    Grad-CAM layer), then ``head`` (global average pooling + linear). Inputs are RGB in [0, 1];
    ``stage1`` starts by standardising each image's channels (``InstanceNorm2d``).

    Attributes:
        classes: class names, in output order.
        default_input_shape: ``(1, 3, 64, 64)``, used by the CLI when no ``--input`` is given.

    Example:
        >>> import torch, hookscope as hs
        >>> net = hs.DemoNet().eval()
        >>> net(torch.rand(2, 3, 64, 64)).shape
        torch.Size([2, 4])
    """

    default_input_shape: tuple[int, ...] = (1, 3, IMAGE_SIZE, IMAGE_SIZE)

    def __init__(self, classes: tuple[str, ...] = DEMO_CLASSES, width: int = 16) -> None:
        super().__init__()
        w = width
        self.classes = tuple(classes)
        # per-image, per-channel standardisation: background colour and contrast vary wildly
        self.stage1 = nn.Sequential(nn.InstanceNorm2d(3), *_conv(3, w), nn.MaxPool2d(2))
        self.stage2 = nn.Sequential(*_conv(w, 2 * w), *_conv(2 * w, 2 * w), nn.MaxPool2d(2))
        self.stage3 = nn.Sequential(*_conv(2 * w, 4 * w), *_conv(4 * w, 4 * w))
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, len(self.classes))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage3(self.stage2(self.stage1(x))))


def load_demo_model(weights: str | Path | None = None) -> DemoNet:
    """The trained demo model, in eval mode, from the weights shipped inside the package.

    Example:
        >>> import hookscope as hs
        >>> model = hs.load_demo_model()
        >>> ds = hs.make_demo_dataset(4, seed=3)
        >>> [model.classes[i] for i in model(ds.images).argmax(1)] == [ds.classes[i] for i in ds.labels]
        True
    """
    path = Path(weights) if weights is not None else WEIGHTS_PATH
    if not path.is_file():
        raise FileNotFoundError(
            f"demo weights {str(path)!r} are missing; run 'python -m hookscope.demo._model train'"
        )
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
        raise ValueError(f"{str(path)!r} is not a hookscope demo weights file (format {_FORMAT})")
    model = DemoNet(tuple(blob["classes"]), width=int(blob["width"]))
    model.load_state_dict(blob["state_dict"])
    return model.eval()


@torch.no_grad()
def evaluate_demo_model(model: nn.Module, data: DemoDataset, *, batch_size: int = 256) -> float:
    """Accuracy of ``model`` on ``data`` (a fraction in [0, 1]); the model's mode is left as found."""
    was_training = model.training
    model.eval()
    try:
        correct = 0
        for i in range(0, len(data), batch_size):
            pred = model(data.images[i : i + batch_size]).argmax(1)
            correct += int((pred == data.labels[i : i + batch_size]).sum())
        return correct / max(1, len(data))
    finally:
        model.train(was_training)


def train_demo_model(
    *,
    epochs: int = 10,
    per_epoch: int = 5000,
    batch_size: int = 32,
    lr: float = 3e-3,
    width: int = 16,
    seed: int = 0,
    val_size: int = 1000,
    log: Callable[[str], Any] | None = print,
) -> DemoNet:
    """Train a fresh :class:`DemoNet` on newly drawn demo data (new pictures every epoch).

    Deterministic for a given seed and thread count on the CPU. ``val_size`` images (seed
    ``TRAIN_SEED - 1``) measure accuracy after each epoch (0: skip). Returns the model in eval mode.
    """
    torch.manual_seed(seed)
    model = DemoNet(width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * (per_epoch // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
    val = make_demo_dataset(val_size, seed=TRAIN_SEED - 1) if val_size else None
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        data = make_demo_dataset(per_epoch, seed=TRAIN_SEED + seed * 1000 + epoch)
        order = torch.randperm(len(data), generator=gen)
        model.train()
        total = 0.0
        for b in range(per_epoch // batch_size):
            idx = order[b * batch_size : (b + 1) * batch_size]
            loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        if log:
            acc = f"  val acc {evaluate_demo_model(model, val):.4f}" if val is not None else ""
            log(
                f"epoch {epoch + 1}/{epochs}: loss {total / (per_epoch // batch_size):.4f}{acc}  "
                f"({time.perf_counter() - t0:.1f}s)"
            )
    return model.eval()


def save_demo_weights(model: DemoNet, path: str | Path = WEIGHTS_PATH) -> Path:
    """Write ``model``'s weights in the format :func:`load_demo_model` reads."""
    width = model.stage3[0].out_channels // 4
    blob = {
        "format": _FORMAT,
        "classes": list(model.classes),
        "width": int(width),
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    path = Path(path)
    torch.save(blob, path)
    return path


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hookscope.demo._model", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the demo model and write its weights")
    t.add_argument("--out", default=str(WEIGHTS_PATH), help="weights file to write")
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument("--per-epoch", type=int, default=5000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2, help="CPU threads (fixed for reproducibility)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    model = train_demo_model(epochs=args.epochs, per_epoch=args.per_epoch, seed=args.seed)
    test = make_demo_dataset(2000, seed=TEST_SEED)
    print(
        f"test accuracy ({len(test)} fresh images, seed {TEST_SEED}): {evaluate_demo_model(model, test):.4f}"
    )
    out = save_demo_weights(model, args.out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
