"""``hookscope cam`` and ``hookscope maps``: a CAM overlay or a feature-map grid for one image.

Both read an image, apply the standard ImageNet preprocessing (resize the shorter side to 256,
center-crop 224, normalise with the ImageNet mean and std; each step can be changed by a flag)
and write a PNG atomically: to a temporary file next to ``--out``, renamed when complete, so a
failure never leaves a partial file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._main import CLIError, add_model_arguments, load, random_weights_note

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one number")
    return vals


def _add_image_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", required=True, metavar="PATH", help="image file (PNG, JPEG, ...)")
    p.add_argument("--layer", required=True, metavar="L", help="layer name or glob (e.g. layer4)")
    p.add_argument("--out", required=True, metavar="PNG", help="output PNG path")
    g = p.add_argument_group("preprocessing (default: ImageNet)")
    g.add_argument(
        "--resize",
        type=int,
        default=256,
        metavar="N",
        help="resize the shorter side to N (0: keep); default 256",
    )
    g.add_argument(
        "--crop",
        type=int,
        default=224,
        metavar="N",
        help="center-crop N x N (0: none); default 224",
    )
    g.add_argument(
        "--mean",
        type=_floats,
        default=IMAGENET_MEAN,
        metavar="M",
        help="per-channel mean, e.g. 0.5,0.5,0.5",
    )
    g.add_argument(
        "--std",
        type=_floats,
        default=IMAGENET_STD,
        metavar="S",
        help="per-channel std, e.g. 0.5,0.5,0.5",
    )
    g.add_argument("--gray", action="store_true", help="feed a 1-channel (grayscale) image")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cam", help="Grad-CAM (or another CAM method) of one image, as a PNG overlay"
    )
    add_model_arguments(p, inputs=False, compile=True)
    _add_image_arguments(p)
    p.add_argument(
        "--target",
        type=int,
        default=None,
        metavar="K",
        help="class index (default: the predicted class)",
    )
    p.add_argument(
        "--method",
        default="gradcam",
        help="gradcam (default), gradcam++, xgradcam, hirescam, layercam, eigencam, scorecam",
    )
    p.add_argument(
        "--alpha", type=float, default=0.5, help="heatmap opacity in [0, 1]; default 0.5"
    )
    p.add_argument("--colormap", default="jet", help="matplotlib colormap; default jet")
    p.set_defaults(func=run_cam)

    p = sub.add_parser("maps", help="a grid of one layer's feature maps for one image, as a PNG")
    add_model_arguments(p, inputs=False, compile=True)
    _add_image_arguments(p)
    p.add_argument(
        "--max-channels",
        type=int,
        default=64,
        metavar="N",
        help="show at most N channels; default 64",
    )
    p.add_argument(
        "--order",
        choices=["energy", "index"],
        default="energy",
        help="strongest channels first, or by index",
    )
    p.add_argument(
        "--normalize",
        choices=["channel", "global"],
        default="channel",
        help="per-channel or one global scale",
    )
    p.set_defaults(func=run_maps)


def load_image(args: argparse.Namespace) -> tuple[Any, Any]:
    """Read and preprocess ``--image``: returns ``(x (1, C, H, W), shown RGB float array (H, W, 3))``."""
    import numpy as np
    import torch

    from ..viz._pictures import _need

    image_mod = _need("PIL.Image")
    path = Path(args.image)
    if not path.is_file():
        raise CLIError(
            f"image {args.image!r} does not exist"
            if not path.exists()
            else f"image {args.image!r} is not a file"
        )
    try:
        with image_mod.open(path) as im:
            im = im.convert("RGB")
    except (OSError, ValueError, image_mod.DecompressionBombError) as e:
        raise CLIError(f"cannot read image {args.image!r}: {type(e).__name__}: {e}") from None
    if args.resize < 0 or args.crop < 0:
        raise CLIError("--resize and --crop must be >= 0")
    if args.resize:
        # torchvision's Resize(N) to the pixel: the shorter side N, the longer truncated
        w, h = im.size
        n = args.resize
        size = (n, max(1, int(n * h / w))) if w <= h else (max(1, int(n * w / h)), n)
        im = im.resize(size, image_mod.BILINEAR)
    if args.crop:
        w, h = im.size
        if args.crop > min(w, h):
            raise CLIError(
                f"--crop {args.crop} is larger than the image ({w}x{h}); lower it or raise --resize"
            )
        # torchvision's CenterCrop: the offsets rounded
        left, top = round((w - args.crop) / 2.0), round((h - args.crop) / 2.0)
        im = im.crop((left, top, left + args.crop, top + args.crop))
    shown = np.asarray(im, dtype=np.float32) / 255.0
    x = torch.from_numpy(shown).permute(2, 0, 1)
    if args.gray:
        x = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2])[None]
    c = x.shape[0]
    mean, std = tuple(args.mean), tuple(args.std)
    if c == 1 and len(mean) == 3:  # --gray with RGB statistics: their average
        mean = (sum(mean) / 3,)
    if c == 1 and len(std) == 3:
        std = (sum(std) / 3,)
    if len(mean) == 1:
        mean = mean * c
    if len(std) == 1:
        std = std * c
    if len(mean) != c or len(std) != c:
        raise CLIError(f"--mean/--std need {c} values (or 1), got {len(mean)} and {len(std)}")
    if any(s == 0 for s in std):
        raise CLIError("--std values must be non-zero")
    x = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return x[None].contiguous(), shown


def _check_out(out: str) -> Path:
    path = Path(out)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"cannot write {out!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise CLIError(f"--out {out!r} is a directory; give a file name such as cam.png")
    return path


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, then rename the temporary file to ``path``; no partial file on failure."""
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else "."
    )
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _cli_imports(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A missing optional dependency (pillow, matplotlib) becomes one line, exit 2."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ImportError as e:
            raise CLIError(str(e)) from None

    return wrapped


@_cli_imports
def run_cam(args: argparse.Namespace) -> int:
    import torch

    from ..cam._base import _logits, get_cam
    from ..core._errors import some_names
    from ..core._select import resolve
    from ..viz._pictures import _colormap_lut, overlay

    method = get_cam(args.method)  # unknown method: one line, before any heavy work
    if not 0.0 <= args.alpha <= 1.0:
        raise CLIError(f"--alpha must be in [0, 1], got {args.alpha}")
    _colormap_lut(args.colormap)
    out = _check_out(args.out)
    x, shown = load_image(args)
    model = load(args)
    resolve(model, args.layer)  # unknown layer: names the closest ones
    x = x.to(next(iter(model.parameters()), x).device)
    target = args.target
    if target is not None and not method.needs_target:  # it was dropped without a word
        raise CLIError(
            f"--target {target}: {method.name} is class-agnostic (the same map for every class); "
            "drop --target, or pick a class-specific method such as gradcam"
        )
    if target is None and method.needs_target:
        with torch.no_grad():
            logits = _logits(model(x))
        if logits.ndim != 2:
            raise CLIError(
                f"the model gives {tuple(logits.shape)}, not (1, num_classes) logits, so there is "
                "no predicted class to explain; pass --target K (for a segmentation model: the "
                "class whose pixels' summed score to explain)"
            )
        target = int(logits.argmax(dim=1)[0])
    explainer = method(model, args.layer)
    cam = explainer(x, target=target)
    picture = overlay(shown, cam[0].cpu(), alpha=args.alpha, colormap=args.colormap)

    def write(tmp: str) -> None:
        from ..viz._pictures import _need

        _need("PIL.Image").fromarray(picture).save(tmp, format="PNG")

    write_atomic(out, write)
    shown_target = "" if not method.needs_target else f", class {target}"
    # the layers used, not the selector: a glob said nothing of what it matched
    used = list(explainer.layers)
    shown_layers = (
        repr(used[0])
        if len(used) == 1
        else f"the average of {len(used)} layers matching {args.layer!r}: {some_names(used)}"
    )
    print(f"wrote {args.out} ({method.name} on {shown_layers}{shown_target})")
    note = random_weights_note(args)
    if note is not None:
        print(note)
    return 0


@_cli_imports
def run_maps(args: argparse.Namespace) -> int:
    import torch

    from ..cam._tokens import to_grid
    from ..core._capture import capture
    from ..core._errors import HookscopeError
    from ..core._nested import first_tensor
    from ..core._select import resolve
    from ..viz._pictures import feature_maps

    if args.max_channels < 1:
        raise CLIError(f"--max-channels must be >= 1, got {args.max_channels}")
    out = _check_out(args.out)
    x, _ = load_image(args)
    model = load(args)
    named = resolve(model, args.layer)
    if len(named) != 1:
        raise CLIError(
            f"--layer {args.layer!r} matches {len(named)} layers ({', '.join(list(named)[:4])}, ...); name one"
        )
    name = next(iter(named))
    x = x.to(next(iter(model.parameters()), x).device)
    with torch.no_grad(), capture(model, named, stop=True) as cap:
        model(x)
    act = first_tensor(cap[name])
    if act is None:
        raise HookscopeError(f"layer {name!r} returned no tensor")
    grid = to_grid(act, image_hw=tuple(x.shape[-2:]), layer=name)
    if grid.ndim != 4:
        raise CLIError(
            f"layer {name!r} gives {tuple(act.shape)}; feature maps need a 2-D grid (B, C, H, W)"
        )
    fig = feature_maps(
        grid[0], max_channels=args.max_channels, order=args.order, normalize=args.normalize
    )
    fig.suptitle(f"{name}: {grid.shape[1]} channels, {args.order} order", fontsize=9)
    write_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    print(
        f"wrote {args.out} ({min(args.max_channels, grid.shape[1])} of {grid.shape[1]} channels of {name!r})"
    )
    return 0
