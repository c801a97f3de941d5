"""Cost per training step of torchvision resnet18 with the training monitor, interleaved.

Contenders, run in rounds (A, B, C, D, E, A, B, ...) so machine noise hits each alike:
bare step; ``Monitor`` logging every step; every 10 steps; sentinel mode (NaN/Inf origin on
every step, no statistics); ``torch.autograd.detect_anomaly``. One block = ``--steps`` training
steps (SGD, cross-entropy); the table reports the median time per step over the rounds.

    .venv/bin/python benchmarks/bench_monitor.py [--size 64] [--batch 16] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torchvision

import hookscope as hs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=64, help="image side (224 is slow on 2 CPU cores)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="training steps per block")
    ap.add_argument("--threads", type=int, default=1, help="1: on a shared 2-core machine 2 threads thrash")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = torchvision.models.resnet18(num_classes=10).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 3, args.size, args.size, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def train(steps: int, mon: hs.Monitor | None) -> None:
        for _ in range(steps):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(opt)
            opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def block(kind: str) -> float:
        mon = None
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if kind == "every step":
            mon = hs.Monitor(model, every=1, alerts="off")
        elif kind == "every 10 steps":
            mon = hs.Monitor(model, every=10, alerts="off")
        elif kind == "sentinel":
            mon = hs.Monitor(model, every=10**9, stats=(), sentinel=True, alerts="off")
        elif kind == "detect_anomaly":
            ctx = torch.autograd.detect_anomaly(check_nan=True)
        try:
            with ctx, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # detect_anomaly announces itself every time
                sync()
                t0 = time.perf_counter()
                train(args.steps, mon)
                sync()
                return (time.perf_counter() - t0) / args.steps
        finally:
            if mon is not None:
                mon.close()

    kinds = ["bare", "every step", "every 10 steps", "sentinel", "detect_anomaly"]
    for k in kinds:  # warm-up
        block(k)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            times[k].append(block(k))
    base = statistics.median(times["bare"])
    print(
        f"resnet18, batch {args.batch}, {args.size}x{args.size}, {dev.type}, {args.threads} threads, "
        f"torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps, median per step"
    )
    print("| contender | ms / step | ratio to bare | min–max ms |")
    print("|---|---:|---:|---:|")
    for k in kinds:
        med = statistics.median(times[k])
        print(f"| {k} | {med * 1e3:.1f} | {med / base:.3f}× | {min(times[k]) * 1e3:.1f}–{max(times[k]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
