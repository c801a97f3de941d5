"""Cost per training step of torchvision resnet18 with the training monitor, interleaved.

Contenders, each training its own replica of the model, take single steps in turn
(A, B, C, D, E, F, A, B, ...) so that machine noise hits each alike:
bare step; ``Monitor`` logging every step (``mon.step()``, and ``mon.step(opt)``, which adds
update-to-weight ratios); every 10 steps; sentinel mode (NaN/Inf origin on every step, no
statistics); ``torch.autograd.detect_anomaly``. Training steps are SGD with momentum and
cross-entropy. Both the process CPU time and the wall time are reported; the "every 10 steps"
contender is averaged over whole cycles of 10 steps (one logged).

    .venv/bin/python benchmarks/bench_monitor.py [--size 224] [--batch 16] [--groups 3]
    .venv/bin/python benchmarks/bench_monitor.py --fsdp --size 64 --batch 8 --groups 3

``--fsdp`` gives the FSDP2 row instead: 2 gloo ranks on CPU, each training a bare and a
monitored (every step, with the optimizer) ``fully_shard`` resnet18, steps alternating.

At resnet18's own input size (224, the default) a run takes about 10 minutes on one CPU thread;
``--size 64 --groups 6`` takes about 4 minutes and is the harder case for the monitor: the
parameter-sized work (norms of 11.7 M weights and gradients) stays the same while the step's
compute shrinks twelvefold.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torchvision

import hookscope as hs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=224, help="image side (default 224)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--groups", type=int, default=3, help="groups of 10 steps per contender")
    ap.add_argument(
        "--threads", type=int, default=1, help="1: on a shared 2-core machine 2 threads thrash"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 row instead: 2 gloo ranks on CPU, bare vs monitored step (see fsdp_main)",
    )
    args = ap.parse_args()
    if args.fsdp:
        return fsdp_main(args)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10).to(dev)
    x = torch.randn(args.batch, 3, args.size, args.size, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()
    kinds = [
        "bare",
        "every step",
        "every step + optimizer",
        "every 10 steps",
        "sentinel",
        "detect_anomaly",
    ]

    # Each contender trains its own replica (hooks on one never touch another), in steady state,
    # and the contenders take single steps in turn: A B C D E F, B C D E F A, ... so that the load
    # of the shared machine, which changes from second to second, hits them alike.
    class Contender:
        def __init__(self, kind: str) -> None:
            self.kind = kind
            self.model = copy.deepcopy(base)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
            self.mon = None
            if kind.startswith("every step"):
                self.mon = hs.Monitor(self.model, every=1, alerts="off")
            elif kind == "every 10 steps":
                self.mon = hs.Monitor(self.model, every=10, alerts="off")
            elif kind == "sentinel":
                self.mon = hs.Monitor(
                    self.model, every=10**9, stats=(), sentinel=True, alerts="off"
                )
            self.cpu: list[float] = []
            self.wall: list[float] = []

        def step(self) -> None:
            ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.kind == "detect_anomaly":
                ctx = torch.autograd.detect_anomaly(check_nan=True)
            with ctx:
                sync()
                w0, c0 = time.perf_counter(), time.process_time()
                loss_fn(self.model(x), y).backward()
                self.opt.step()
                if self.mon is not None:
                    self.mon.step(None if self.kind == "every step" else self.opt)
                self.opt.zero_grad(set_to_none=True)
                sync()
                self.cpu.append(time.process_time() - c0)
                self.wall.append(time.perf_counter() - w0)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # detect_anomaly announces itself every time
        cs = [Contender(k) for k in kinds]
        for _ in range(10):  # warm-up: one full every-10 cycle
            for c in cs:
                c.step()
        for c in cs:
            c.cpu.clear()
            c.wall.clear()
        for i in range(10 * args.groups):
            # rotate the order every step: each contender follows each other one equally often
            # (a step after detect_anomaly, for one, runs measurably slower)
            for c in cs[i % len(cs) :] + cs[: i % len(cs)]:
                c.step()
        for c in cs:
            if c.mon is not None:
                c.mon.close()

    def per_group(v: list[float]) -> list[float]:
        return [sum(v[i : i + 10]) / 10 for i in range(0, len(v), 10)]

    bare = cs[0]
    print(
        f"resnet18, batch {args.batch}, {args.size}x{args.size}, {dev.type}, {args.threads} thread(s), "
        f"torch {torch.__version__}; {args.groups} groups x 10 steps per contender, steps interleaved"
    )
    print(
        "ratio = median over groups of 10 steps of (contender mean / bare mean of the same group); "
        "best = fastest group of the contender / fastest group of bare (least disturbed)"
    )
    print(
        "| contender | CPU ms / step | ratio (CPU) | best (CPU) | wall ms / step | ratio (wall) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for c in cs:
        gc, gb = per_group(c.cpu), per_group(bare.cpu)
        rc = statistics.median(a / b for a, b in zip(gc, gb))
        rw = statistics.median(a / b for a, b in zip(per_group(c.wall), per_group(bare.wall)))
        print(
            f"| {c.kind} | {statistics.median(gc) * 1e3:.0f} | {rc:.3f}× | {min(gc) / min(gb):.3f}× | "
            f"{statistics.median(per_group(c.wall)) * 1e3:.0f} | {rw:.3f}× |"
        )


def _fsdp_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def replica() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
            for block in layer:
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    (bare, bare_opt), (watched, opt) = replica(), replica()
    mon = hs.Monitor(watched, every=1, alerts="off")
    wall: dict[str, list[float]] = {"bare": [], "monitored": []}

    def step(kind: str) -> None:
        model, o = (bare, bare_opt) if kind == "bare" else (watched, opt)
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        o.step()
        if kind == "monitored":
            mon.step(o)
        o.zero_grad(set_to_none=True)
        wall[kind].append(time.perf_counter() - t0)

    for _ in range(3):
        step("bare")
        step("monitored")
    wall = {"bare": [], "monitored": []}
    for i in range(10 * args.groups):
        for kind in ("bare", "monitored") if i % 2 == 0 else ("monitored", "bare"):
            step(kind)
    mon.close()
    if rank == 0:
        g = {k: [sum(v[i : i + 10]) / 10 for i in range(0, len(v), 10)] for k, v in wall.items()}
        print(
            f"FSDP2 (fully_shard per BasicBlock + root), 2 gloo ranks on CPU, resnet18, batch "
            f"{args.batch} per rank, {args.size}x{args.size}, {args.threads} thread(s) per rank, "
            f"torch {torch.__version__}; {args.groups} groups x 10 steps, alternating"
        )
        print("| contender | wall ms / step | ratio (median over groups) | best |")
        print("|---|---:|---:|---:|")
        for k in ("bare", "monitored"):
            print(
                f"| {k} | {statistics.median(g[k]) * 1e3:.0f} | "
                f"{statistics.median(a / b for a, b in zip(g[k], g['bare'])):.3f}× | "
                f"{min(g[k]) / min(g['bare']):.3f}× |"
            )
    dist.destroy_process_group()


def fsdp_main(args: argparse.Namespace) -> None:
    """Monitored step (every step, with the optimizer) / bare step under FSDP2 on 2 CPU ranks:
    each rank trains a bare and a monitored replica, steps alternating (wall time of rank 0; the
    ranks run in lockstep through FSDP2's collectives)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_fsdp_rank, args=(port, args), nprocs=2, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
