"""hs.summary wall time vs one bare forward and vs torchinfo.summary, interleaved in one run.

Each round runs, in turn: a bare ``model(x)`` under ``torch.no_grad()``; ``hs.summary(model, x)``
(one forward with hooks on every module, per-layer timing, dispatcher FLOP counting and memory
tracking); ``torchinfo.summary(model, input_data=x, verbose=0)``. Medians over the rounds, and
ratios to the bare forward. The interleaving spreads the noise of a shared machine over all three.

    .venv/bin/python benchmarks/bench_summary.py [--model resnet50] [--size 224] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

import hookscope as hs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="resnet50", help="a torchvision.models builder (default resnet50)"
    )
    ap.add_argument("--size", type=int, default=224, help="input image size (default 224)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: steadier on a shared machine)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = getattr(torchvision.models, args.model)().eval()
    x = torch.randn(1, 3, args.size, args.size)

    def bare() -> None:
        with torch.no_grad():
            model(x)

    def summary() -> None:
        hs.summary(model, x)

    contenders = {"bare forward": bare, "hs.summary": summary}
    try:
        import torchinfo

        contenders["torchinfo.summary"] = lambda: torchinfo.summary(model, input_data=x, verbose=0)
    except ImportError:
        print("torchinfo not installed: skipped")

    for fn in contenders.values():  # warm-up: allocator, oneDNN primitives, imports
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["bare forward"])
    print(
        f"{args.model}, input (1, 3, {args.size}, {args.size}), eval, CPU, {args.threads} threads, "
        f"torch {torch.__version__}, {args.rounds} interleaved rounds\n"
    )
    print("| contender | median ms | min ms | × bare forward |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {med / base:.2f} |")
    if "torchinfo.summary" in times:
        ratio = statistics.median(times["hs.summary"]) / statistics.median(
            times["torchinfo.summary"]
        )
        print(f"\nhs.summary / torchinfo.summary: {ratio:.2f}")


if __name__ == "__main__":
    main()
