"""Grad-CAM cost on resnet50, interleaved: bare forward, hookscope, pytorch-grad-cam, Captum.

Run: ``.venv/bin/python benchmarks/bench_cam.py [--batch 8] [--size 224] [--reps 5]``

Contenders, each producing (or, for the bare forward, standing in for) a batch of Grad-CAM maps
of ``layer4`` for the predicted classes:

* ``bare forward``: ``model(x)`` under ``torch.no_grad()``, the floor.
* ``hookscope``: ``hs.GradCAM(model, "layer4")(x)``: autograd only after layer4, maps upsampled
  and normalised on the device.
* ``pytorch-grad-cam``: ``GradCAM(model, [model.layer4])(x, None)``: full forward with autograd,
  backward through the whole network (parameter gradients included), numpy/cv2 post-processing.
* ``captum``: ``LayerGradCam(model, model.layer4).attribute(x, target=pred)`` plus
  ``LayerAttribution.interpolate`` to the input size. Captum needs explicit targets: the
  predicted classes are computed once, outside the timing (an advantage the others do not get).

Rounds rotate the order of the contenders; the table reports the median and minimum wall time
per contender, the median's ratio to the bare forward, and the median process CPU time (less
sensitive than wall time to other jobs on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torchvision

import hookscope as hs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    x = torch.randn(args.batch, 3, args.size, args.size)

    contenders = {}

    def bare() -> None:
        with torch.no_grad():
            model(x)

    contenders["bare forward (no grad)"] = bare

    cam = hs.GradCAM(model, "layer4")
    contenders["hookscope GradCAM"] = lambda: cam(x)

    try:
        from pytorch_grad_cam import GradCAM as PGC

        def pgc() -> None:
            with PGC(model, [model.layer4]) as ref:
                ref(x, None)
            model.zero_grad(set_to_none=True)

        contenders["pytorch-grad-cam GradCAM"] = pgc
    except ImportError:
        print("pytorch-grad-cam not installed: skipped", file=sys.stderr)

    try:
        from captum.attr import LayerAttribution, LayerGradCam

        lgc = LayerGradCam(model, model.layer4)
        with torch.no_grad():
            pred = model(x).argmax(1)

        def captum() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                attr = lgc.attribute(x, target=pred, relu_attributions=True)
            LayerAttribution.interpolate(attr, x.shape[-2:], interpolate_mode="bilinear")

        contenders["Captum LayerGradCam + upsample"] = captum
    except ImportError:
        print("captum not installed: skipped", file=sys.stderr)

    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up
        contenders[n]()
    for r in range(args.reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            c0, t0 = time.process_time(), time.perf_counter()
            contenders[n]()
            times[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
        print(
            f"round {r + 1}/{args.reps}: "
            + ", ".join(f"{n.split()[0]} {times[n][-1]:.2f}s" for n in names),
            file=sys.stderr,
        )

    base = statistics.median(times[names[0]])
    hs_med = statistics.median(times["hookscope GradCAM"])
    print(
        f"resnet50, batch {args.batch}, {args.size}x{args.size}, CPU ({platform.processor() or platform.machine()}), "
        f"{args.threads} threads, torch {torch.__version__}, {args.reps} interleaved rounds after a warm-up\n"
    )
    cpu_base = statistics.median(cpu[names[0]])
    print(
        "| contender | median wall (s) | min wall (s) | × bare forward | hookscope faster by | median CPU (s) | CPU × bare |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        med, cmed = statistics.median(times[n]), statistics.median(cpu[n])
        faster = "" if n.startswith(("bare", "hookscope")) else f"{med / hs_med:.2f}×"
        print(
            f"| {n} | {med:.3f} | {min(times[n]):.3f} | {med / base:.2f} | {faster} | {cmed:.2f} | {cmed / cpu_base:.2f} |"
        )
    assert hs.hooks_on(model) == [], "a contender left hooks behind"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
