"""``hookscope extract MODEL --data DIR --layers avgpool,layer3 --out feats/``: features of a folder
of images to disk, resumable; under ``torchrun`` the images are split across the processes."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings

import torch

from ._main import CLIError, add_model_arguments, load

_POOLS = ("none", "avg", "max", "flatten", "cls")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "extract",
        help="save layer features of a folder of images to .npy files (resumable, distributed)",
        description=(
            "Run MODEL over every image under --data and save the outputs of --layers to --out: one "
            "<layer>.npy per layer, index.npy (file paths) and manifest.json (written last). Re-run the "
            "same command to continue an interrupted run. Under 'torchrun --nproc-per-node N -m "
            "hookscope extract ...' the images are split across the N processes."
        ),
    )
    add_model_arguments(p, inputs=False, compile=True)
    p.add_argument(
        "--data",
        required=True,
        metavar="DIR",
        help="folder of images (sub-folders = classes, or flat)",
    )
    p.add_argument(
        "--layers", required=True, help="comma-separated layer names or globs, e.g. avgpool,layer3"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--pool",
        default="none",
        choices=_POOLS,
        help="reduce each output to a vector (default: none)",
    )
    p.add_argument(
        "--batch-size", type=int, default=64, metavar="N", help="images per batch (default 64)"
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="DataLoader worker processes decoding images (default: min(4, CPUs))",
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=224,
        metavar="PX",
        help="resize the shorter side to PX/0.875, centre-crop PX (default 224)",
    )
    p.add_argument(
        "--dtype", default=None, help="saved dtype: float32 or float16 (default: the layers' own)"
    )
    p.add_argument(
        "--on-error",
        default="raise",
        choices=("raise", "skip"),
        help="an image that does not decode: stop (default) or record it in the manifest and go on",
    )
    p.add_argument(
        "--no-resume", action="store_true", help="start over instead of continuing a run in --out"
    )
    p.add_argument(
        "--verify",
        default="all",
        choices=("all", "sample"),
        help="on resume, re-read all finished batches (default) or a spread of 8 to check that "
        "the images are those the earlier run read",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _init_distributed(device: str) -> bool:
    """Join the torchrun job described by the environment; True if this call started it."""
    import torch.distributed as dist

    if (
        int(os.environ.get("WORLD_SIZE", "1")) <= 1
        or not dist.is_available()
        or dist.is_initialized()
    ):
        return False
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # generous timeout: the final barrier waits for the slowest shard of a long run
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(hours=12))
    return True


def run(args: argparse.Namespace) -> int:
    from ..extraction._extract import extract
    from ..extraction._imagefolder import ImageFolder
    from ..extraction._job import SkippedSamplesWarning

    layers = [s.strip() for s in args.layers.split(",") if s.strip()]
    if not layers:
        raise CLIError("--layers is empty: name at least one layer, e.g. --layers avgpool")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_workers < 0:
        raise CLIError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.image_size < 1:
        raise CLIError(f"--image-size must be >= 1, got {args.image_size}")
    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if (
            not isinstance(dtype, torch.dtype)
            or not dtype.is_floating_point
            or dtype == torch.bfloat16
        ):
            raise CLIError(f"unknown or unsupported --dtype {args.dtype!r}; use float32 or float16")
    if not os.path.isdir(args.data):
        raise CLIError(f"--data {args.data!r} is not a directory")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise CLIError("reading images needs Pillow: pip install 'hookscope[viz]'") from None

    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and args.device.startswith("cuda")
        and ":" not in args.device
    ):
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    started = _init_distributed(args.device)
    try:
        model = load(args)
        dataset = ImageFolder(args.data, image_size=args.image_size)
        with warnings.catch_warnings():  # the count of skipped images is printed below
            warnings.simplefilter("ignore", SkippedSamplesWarning)
            feats = extract(
                model,
                dataset,
                layers,
                args.out,
                batch_size=args.batch_size,
                num_workers=args.num_workers,
                pool=None if args.pool == "none" else args.pool,
                dtype=dtype,
                resume=not args.no_resume,
                progress=not args.no_progress,
                on_error=args.on_error,
                verify=args.verify,
            )
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        shapes = ", ".join(f"{k} {tuple(v[1:])}" for k, v in feats.manifest["shapes"].items())
        skipped = f"; {len(feats.skipped)} skipped (see manifest.json)" if feats.skipped else ""
        print(f"wrote {feats.count} samples to {args.out}: {shapes}{skipped}", file=sys.stdout)
    return 0
