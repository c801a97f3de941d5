"""Where the training monitor's cost goes, inside a real resnet18 training step.

Five contenders take single steps in turn (order rotated): bare; the monitor (every step);
the monitor with no-op statistics (hooks and record only); without activation statistics; without
gradient statistics. The statistics functions the monitor calls are wrapped with timers, so each
line shows the median step time, its excess over bare, and the milliseconds per step spent in
activation, output-gradient and parameter statistics.

    .venv/bin/python benchmarks/profile_monitor.py [--size 224] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torchvision

import hookscope as hs
from hookscope.monitor import _monitor

KINDS = ("bare", "monitor", "no-op stats", "no act stats", "no grad stats")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="measured steps per contender")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    real = {
        "act": _monitor.act_stats,
        "grad": _monitor.grad_stats,
        "param": _monitor.param_stats,
    }
    spent = dict.fromkeys(real, 0.0)

    def timed(key: str) -> Callable[..., Any]:
        fn = real[key]

        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    def noop_act(t: torch.Tensor, *a: Any) -> tuple[list[float], None]:
        return [0.0, 1.0, 1.0, 1.0, float(t.numel())], None

    def noop_grad(g: torch.Tensor) -> list[float]:
        return [1.0, -1.0, 1.0]

    class Contender:
        def __init__(self, kind: str) -> None:
            self.kind = kind
            self.model = copy.deepcopy(base)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
            self.mon = None if kind == "bare" else hs.Monitor(self.model, alerts="off")
            self.times: list[float] = []
            self.spent = dict.fromkeys(real, 0.0)

        def step(self) -> None:
            noop = self.kind == "no-op stats"
            _monitor.act_stats = noop_act if noop or self.kind == "no act stats" else timed("act")
            _monitor.grad_stats = (
                noop_grad if noop or self.kind == "no grad stats" else timed("grad")
            )
            _monitor.param_stats = timed("param")
            for k in spent:
                spent[k] = 0.0
            t = time.process_time()
            loss_fn(self.model(x), y).backward()
            self.opt.step()
            if self.mon is not None:
                self.mon.step()
            self.opt.zero_grad(set_to_none=True)
            self.times.append(time.process_time() - t)
            for k, v in spent.items():
                self.spent[k] += v

    cs = [Contender(k) for k in KINDS]
    try:
        for _ in range(2):  # warm-up
            for c in cs:
                c.step()
        for c in cs:
            c.times.clear()
            c.spent = dict.fromkeys(real, 0.0)
        for i in range(args.steps):
            for c in cs[i % len(cs) :] + cs[: i % len(cs)]:
                c.step()
    finally:
        for key, fn in real.items():
            setattr(_monitor, f"{key}_stats", fn)
        for c in cs:
            if c.mon is not None:
                c.mon.close()
    bare = statistics.median(cs[0].times)
    print(f"resnet18, batch {args.batch}, {args.size}x{args.size}, 1 thread, CPU time per step")
    for c in cs:
        med = statistics.median(c.times)
        parts = " ".join(f"{k}={v / args.steps * 1e3:.1f}" for k, v in c.spent.items())
        print(
            f"{c.kind:14s} {med * 1e3:7.1f} ms  x{med / bare:.3f}  "
            f"+{(med - bare) * 1e3:6.1f} ms  {parts}"
        )


if __name__ == "__main__":
    main()
