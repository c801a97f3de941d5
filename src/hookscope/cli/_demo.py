"""``hookscope demo [--out DIR]`` and ``hookscope report MODEL --image PATH [--layer L]``: a
self-contained HTML report (summary, feature maps, Grad-CAM, gradient flow, NaN origin)."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._main import CLIError, add_model_arguments, load, random_weights_note


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="write an HTML report of what hookscope sees inside the built-in demo CNN"
    )
    p.add_argument(
        "--out",
        default="hookscope-demo",
        metavar="DIR",
        help="directory for report.html (default: ./hookscope-demo)",
    )
    p.add_argument(
        "--images",
        type=int,
        default=8,
        metavar="N",
        help="test images shown with Grad-CAM (default 8)",
    )
    p.add_argument(
        "--steps", type=int, default=20, metavar="N", help="monitored training steps (default 20)"
    )
    p.set_defaults(func=run_demo)

    p = sub.add_parser("report", help="write the same HTML report for your model and one image")
    add_model_arguments(p, inputs=False)
    p.add_argument("--image", required=True, metavar="PATH", help="image file (PNG, JPEG, ...)")
    p.add_argument(
        "--layer",
        default=None,
        metavar="L",
        help="Grad-CAM layer (default: the last top-level layer with a spatial output)",
    )
    p.add_argument(
        "--out",
        default="hookscope-report",
        metavar="DIR",
        help="directory for report.html (default: ./hookscope-report)",
    )
    g = p.add_argument_group(
        "preprocessing (default: ImageNet; the demo model: 64×64, no normalisation)"
    )
    g.add_argument(
        "--resize",
        type=int,
        default=None,
        metavar="N",
        help="resize the shorter side to N (0: keep)",
    )
    g.add_argument(
        "--crop", type=int, default=None, metavar="N", help="center-crop N x N (0: none)"
    )
    g.add_argument("--mean", default=None, metavar="M", help="per-channel mean, e.g. 0.5,0.5,0.5")
    g.add_argument("--std", default=None, metavar="S", help="per-channel std, e.g. 0.5,0.5,0.5")
    g.add_argument("--gray", action="store_true", help="feed a 1-channel (grayscale) image")
    p.set_defaults(func=run_report)


@contextlib.contextmanager
def _out_dir(out: str) -> Iterator[Path]:
    """``--out`` as a directory, made (with its parents) before the work so a bad path fails
    first; the directories made are removed again when the work fails, so a failed run leaves
    no empty folder behind."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise CLIError(
            f"--out {out!r} is a file; give a directory (the report is written as DIR/report.html)"
        )
    made = [p for p in [path, *path.parents] if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot create directory {out!r}: {e.strerror or e}") from None
    try:
        yield path
    except BaseException:
        for p in made:  # deepest first; only if still empty
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _print_summary(facts: Any, path: Path, seconds: float, note: str | None = None) -> None:
    lines = [
        f"model: {facts.model}"
        + (f" ({facts.params:,} parameters)" if facts.params is not None else "")
    ]
    if facts.correct is not None:
        lines.append(f"test images classified right: {facts.correct}/{facts.shown}")
    if facts.cam_in_box is not None:
        lines.append(
            f"Grad-CAM ({facts.cam_layer}) peak inside the shape's box: {facts.cam_in_box}/{facts.correct}"
        )
    elif facts.cam_layer:
        lines.append(f"Grad-CAM layer: {facts.cam_layer}")
        if facts.predictions:
            lines.append(f"prediction: {', '.join(facts.predictions[:4])}")
    if note is not None:
        lines.append(note)
    if "gradient flow" in facts.seconds and "gradient flow" not in facts.unavailable:
        alerts = "; ".join(facts.flow_alerts[:3]) if facts.flow_alerts else "none"
        lines.append(f"monitor alerts over the short training run: {alerts}")
    if facts.nonfinite:
        lines.append(f"NaN origin: {facts.nonfinite}")
    for what, why in facts.unavailable.items():
        lines.append(f"not available: {what} ({why.splitlines()[0]})")
    lines.append(f"report: {path.resolve()}  ({seconds:.1f}s)")
    print("\n".join(lines))


def run_demo(args: argparse.Namespace) -> int:
    from ..demo._report import build_demo_report

    if args.images < 1 or args.steps < 1:
        raise CLIError("--images and --steps must be >= 1")
    import torch

    t0 = time.perf_counter()
    with _out_dir(args.out) as out:
        # The demo's tensors are tiny: one intra-op thread is as fast on an idle machine and
        # avoids OpenMP threads spinning at barriers (up to ~8x slower) when other processes
        # share the CPUs.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            report, facts = build_demo_report(n_images=args.images, steps=args.steps)
        finally:
            torch.set_num_threads(threads)
        path = report.write(out / "report.html")
    _print_summary(facts, path, time.perf_counter() - t0)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from ..demo._report import build_model_report
    from ._cam import IMAGENET_MEAN, IMAGENET_STD, load_image

    t0 = time.perf_counter()
    demo = args.model == "demo"
    args.resize = args.resize if args.resize is not None else (64 if demo else 256)
    args.crop = args.crop if args.crop is not None else (64 if demo else 224)
    args.mean = _floats(args.mean, "--mean") if args.mean else ((0.0,) if demo else IMAGENET_MEAN)
    args.std = _floats(args.std, "--std") if args.std else ((1.0,) if demo else IMAGENET_STD)
    model = load(args)
    x, shown = load_image(args)
    x = x.to(next((p.device for p in model.parameters()), x.device))
    with _out_dir(args.out) as out:
        report, facts = build_model_report(model, x, shown, name=args.model, layer=args.layer)
        path = report.write(out / "report.html")
    _print_summary(facts, path, time.perf_counter() - t0, random_weights_note(args))
    return 0


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CLIError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise CLIError(f"{flag}: expected at least one number")
    return vals
