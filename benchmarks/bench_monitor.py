"""Cost per training step of torchvision resnet18 with the training monitor, interleaved.

Contenders, run in rounds (A, B, C, D, E, A, B, ...) so machine noise hits each alike:
bare step; ``Monitor`` logging every step (``mon.step()``, and ``mon.step(opt)``, which adds
update-to-weight ratios); every 10 steps; sentinel mode (NaN/Inf origin on every step, no
statistics); ``torch.autograd.detect_anomaly``. One block = ``--steps`` training steps (SGD,
cross-entropy). Both the process CPU time and the wall time are reported: with one thread, CPU
time is what the step costs and is far less disturbed by other processes on a shared machine.

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

    def train(steps: int, mon: hs.Monitor | None, with_opt: bool) -> None:
        for _ in range(steps):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(opt if with_opt else None)
            opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def block(kind: str) -> tuple[float, float]:
        mon = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # detect_anomaly announces itself every time
            ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
            if kind.startswith("every step"):
                mon = hs.Monitor(model, every=1, alerts="off")
            elif kind == "every 10 steps":
                mon = hs.Monitor(model, every=10, alerts="off")
            elif kind == "sentinel":
                mon = hs.Monitor(model, every=10**9, stats=(), sentinel=True, alerts="off")
            elif kind == "detect_anomaly":
                ctx = torch.autograd.detect_anomaly(check_nan=True)
            try:
                with ctx:
                    sync()
                    w0, c0 = time.perf_counter(), time.process_time()
                    train(args.steps, mon, with_opt=kind != "every step")
                    sync()
                    return (time.perf_counter() - w0) / args.steps, (time.process_time() - c0) / args.steps
            finally:
                if mon is not None:
                    mon.close()

    kinds = ["bare", "every step", "every step + optimizer", "every 10 steps", "sentinel", "detect_anomaly"]
    for k in kinds:  # warm-up
        block(k)
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            w, c = block(k)
            wall[k].append(w)
            cpu[k].append(c)
    print(
        f"resnet18, batch {args.batch}, {args.size}x{args.size}, {dev.type}, {args.threads} thread(s), "
        f"torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps"
    )
    print("ratio = median over rounds of (contender / bare of the same round)")
    print("| contender | CPU ms / step | ratio (CPU time) | wall ms / step | ratio (wall) |")
    print("|---|---:|---:|---:|---:|")
    for k in kinds:
        rc = statistics.median(a / b for a, b in zip(cpu[k], cpu["bare"]))
        rw = statistics.median(a / b for a, b in zip(wall[k], wall["bare"]))
        print(
            f"| {k} | {statistics.median(cpu[k]) * 1e3:.0f} | {rc:.3f}× | "
            f"{statistics.median(wall[k]) * 1e3:.0f} | {rw:.3f}× |"
        )


if __name__ == "__main__":
    main()
