"""hookscope on a torch.compile'd model (inductor, CPU): cost of a scope, of a monitor, recompiles.

Run: ``python benchmarks/bench_compile.py [--size 64] [--batch 4] [--rounds 15]``.
Contenders are timed interleaved in one run, so the ratios share the machine's noise.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo as dynamo
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

sys.path.insert(0, str(Path(__file__).parent))
import hookscope as hs
from _timing import interleaved, table


def resnet18() -> nn.Module:
    from torchvision.models import resnet18 as make

    torch.manual_seed(0)
    return make(num_classes=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--stat", choices=["median", "min"], default="min", help="min: noise only ever adds time"
    )
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*non-leaf Tensor")
    x = torch.randn(a.batch, 3, a.size, a.size)
    rows = []

    # 1. capture of one layer around a compiled forward (inference)
    model = resnet18().eval()
    cm = torch.compile(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        cm(x)
        with hs.capture(cm, ["layer3"]):
            cm(x)
    first = time.perf_counter() - t0

    def bare() -> None:
        with torch.no_grad():
            cm(x)

    def captured() -> None:
        with torch.no_grad(), hs.capture(cm, ["layer3"]) as cap:
            cm(x)
        cap["layer3"]

    eager = copy.deepcopy(model)

    def eager_fwd() -> None:
        with torch.no_grad():
            eager(x)

    t = interleaved(
        {"compiled": bare, "compiled + capture": captured, "eager": eager_fwd},
        rounds=a.rounds,
        inner=3,
        stat=a.stat,
    )
    rows += [
        ["forward: compiled", f"{t['compiled'] * 1e3:.1f}", "1.00"],
        [
            "forward: compiled + capture('layer3')",
            f"{t['compiled + capture'] * 1e3:.1f}",
            f"{t['compiled + capture'] / t['compiled']:.3f}",
        ],
        ["forward: eager", f"{t['eager'] * 1e3:.1f}", f"{t['eager'] / t['compiled']:.3f}"],
    ]

    # 2. Monitor(every=10) over compiled training steps
    dynamo.reset()
    net = resnet18()
    net.compile()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    y = torch.randint(0, 10, (a.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    mon = hs.Monitor(net, every=10, alerts="off")

    def monitored() -> None:
        train_step()
        mon.step()

    for _ in range(12):  # compile both graphs (bare and hooked) before timing
        monitored()
    t = interleaved(
        {"bare": train_step, "monitored": monitored}, rounds=a.rounds, inner=10, stat=a.stat
    )
    mon.close()
    rows += [
        ["train step: compiled", f"{t['bare'] * 1e3:.1f}", "1.00"],
        [
            "train step: compiled + Monitor(every=10)",
            f"{t['monitored'] * 1e3:.1f}",
            f"{t['monitored'] / t['bare']:.3f}",
        ],
    ]

    # 3. recompiles: the same scope opened and closed 20 times
    dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    model = resnet18().eval()
    cm = torch.compile(model, backend=counter)
    with torch.no_grad():
        cm(x)
        before = counter.frame_count
        for _ in range(20):
            with hs.capture(cm, ["layer3"]):
                cm(x)
        cm(x)
    rows.append(
        [
            "frames compiled by 20 capture scopes (after the bare compile)",
            counter.frame_count - before,
            "",
        ]
    )
    rows.append(["first compiled + first captured call (s)", f"{first:.1f}", ""])
    print(
        f"resnet18, batch {a.batch}, {a.size}x{a.size}, CPU, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, inductor, {a.stat} of {a.rounds} interleaved rounds"
    )
    print(table(["what", "ms", "ratio"], rows))


if __name__ == "__main__":
    main()
