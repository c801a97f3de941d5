"""hs.summary wall time vs one bare forward and vs torchinfo.summary, interleaved in one run.

Each round runs, in an order rotated every round: a bare ``model(x)`` under ``torch.no_grad()``;
``hs.summary(model, x)`` (one forward with hooks on every module, per-layer timing, dispatcher FLOP
counting and memory tracking); ``torchinfo.summary(model, input_data=x, verbose=0)``. Medians (and
minima) over the rounds, ratios to the bare forward, and hs.summary / torchinfo per model. The
interleaving spreads the noise of a shared machine over all three.

    .venv/bin/python benchmarks/bench_summary.py [--models resnet50,vit_b_16] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torchvision

import hookscope as hs
from _timing import samples, table


def bench(name: str, size: int, rounds: int) -> list[list[object]]:
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(1, 3, size, size)

    def bare() -> None:
        with torch.no_grad():
            model(x)

    contenders = {"bare forward": bare, "hs.summary": lambda: hs.summary(model, x)}
    try:
        import torchinfo

        contenders["torchinfo.summary"] = lambda: torchinfo.summary(model, input_data=x, verbose=0)
    except ImportError:
        print("torchinfo not installed: skipped")
    got = samples(contenders, rounds, warmup=2)
    med = {k: statistics.median(v) for k, v in got.items()}
    rows: list[list[object]] = []
    for k, v in got.items():
        vs_ti = f"{med[k] / med['torchinfo.summary']:.2f}" if "torchinfo.summary" in med else "-"
        rows.append(
            [
                name,
                k,
                f"{med[k] * 1e3:.1f}",
                f"{min(v) * 1e3:.1f}",
                f"{med[k] / med['bare forward']:.2f}",
                vs_ti,
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default="resnet50,resnet18,mobilenet_v3_large,vit_b_16",
        help="comma-separated torchvision.models builders (the issue's goal is on resnet50)",
    )
    ap.add_argument("--size", type=int, default=224, help="input image size (default 224)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: steadier on a shared machine)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for name in args.models.split(",") for r in bench(name, args.size, args.rounds)]
    print(
        f"input (1, 3, {args.size}, {args.size}), eval, CPU, {args.threads} thread(s), "
        f"torch {torch.__version__}, {args.rounds} interleaved rounds (order rotated)\n"
    )
    print(
        table(["model", "contender", "median ms", "min ms", "× bare (median)", "× torchinfo"], rows)
    )


if __name__ == "__main__":
    main()
