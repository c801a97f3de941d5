"""images/s of ``hookscope.extract`` vs a bare forward loop over the same DataLoader.

resnet50 (random weights: no download), synthetic 3x64x64 images held in memory (so loading is
not what is measured), batch 16, 64 images per run, CPU. Contenders run interleaved
(bare, extract avgpool, extract layer2, bare, ...) so machine noise hits all alike; the table
gives medians. ``extract`` writes to a fresh directory on local disk each run (files created,
pre-allocated, flushed, journaled, manifest written). The last contender asks for a finished
run again: ``extract`` re-reads its data (no forward pass) to check it is what the run read.

Run: .venv/bin/python benchmarks/bench_extract.py [--reps 3] [--images 64] [--size 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookscope as hs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    data = TensorDataset(
        torch.randn(args.images, 3, args.size, args.size),
        torch.zeros(args.images, dtype=torch.long),
    )
    loader = DataLoader(data, batch_size=args.batch, num_workers=0)
    tmp = tempfile.mkdtemp(prefix="bench_extract_")

    def bare() -> None:
        with torch.inference_mode():
            for x, _ in loader:
                model(x)

    def run_extract(layer: str, pool: str | None) -> None:
        out = os.path.join(tmp, layer)
        shutil.rmtree(out, ignore_errors=True)
        hs.extract(model, loader, [layer], out, pool=pool, progress=False, resume=False)

    again = os.path.join(tmp, "again")

    def run_again() -> None:  # a finished run asked for again: its data are read and checked
        hs.extract(model, loader, ["avgpool"], again, progress=False)

    contenders = {
        "bare forward loop (all layers, nothing saved)": bare,
        "extract avgpool (2048 floats/img to disk)": lambda: run_extract("avgpool", None),
        "extract layer2 (512x8x8 floats/img to disk)": lambda: run_extract("layer2", None),
        "extract avgpool again (finished: data re-read and checked, no forward)": run_again,
    }
    bare()  # warm-up
    run_again()  # the finished run the last contender asks for
    names = list(contenders)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate the order
            t0, c0 = time.perf_counter(), time.process_time()
            contenders[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    shutil.rmtree(tmp, ignore_errors=True)
    bare_name = names[0]
    print(
        f"resnet50, {args.images} images {args.size}x{args.size}, batch {args.batch}, {torch.get_num_threads()} threads, "
        f"{args.reps} interleaved reps (order rotated), medians; ratio = median over reps of bare time / contender time"
    )
    print(
        "| contender | images/s (wall) | vs bare loop (wall) | CPU ms/image | vs bare loop (CPU) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in names:
        w = statistics.median(wall[name])
        c = statistics.median(cpu[name])
        rw = statistics.median(b / t for b, t in zip(wall[bare_name], wall[name]))
        rc = statistics.median(b / t for b, t in zip(cpu[bare_name], cpu[name]))
        print(
            f"| {name} | {args.images / w:.1f} | {rw:.2f}x | {1000 * c / args.images:.0f} | {rc:.2f}x |"
        )


if __name__ == "__main__":
    main()
