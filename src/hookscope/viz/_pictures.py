"""Pictures: a CAM blended over an image, and a grid of a layer's feature maps.

matplotlib and pillow are optional (``pip install hookscope[viz]``); they are imported only when a
function here is called.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..core._errors import HookscopeError
from ..core._optional import need

__all__ = ["feature_maps", "overlay"]


def _need(module: str) -> Any:
    return need(module, "viz", "drawing pictures")


def _colormap_lut(colormap: str) -> np.ndarray:
    """``(256, 3)`` float32 RGB in [0, 1] for a matplotlib colormap name."""
    mpl = _need("matplotlib")
    try:
        cmap = mpl.colormaps[colormap]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(colormap, list(mpl.colormaps), n=3)
        raise ValueError(
            f"unknown colormap {colormap!r}; did you mean {', '.join(close) or 'jet, viridis, inferno'}?"
        ) from None
    return np.asarray(cmap(np.linspace(0.0, 1.0, 256))[:, :3], dtype=np.float32)


def _as_map(cam: Any) -> torch.Tensor:
    t = (
        torch.as_tensor(np.asarray(cam) if not isinstance(cam, torch.Tensor) else cam)
        .detach()
        .float()
    )
    while t.ndim > 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 2:
        raise HookscopeError(
            f"overlay: cam must be one map (H, W), got shape {tuple(t.shape)}; pick a sample: cam[i]"
        )
    if t.isnan().any():
        raise HookscopeError("overlay: cam holds NaN values; a map to show must be finite")
    lo, hi = float(t.min()), float(t.max())
    if lo < -_SLACK or hi > 1 + _SLACK:
        # clamped, a raw map would show the hottest colour wherever it passes 1
        raise HookscopeError(
            f"overlay: cam values must be in [0, 1], got [{lo:.4g}, {hi:.4g}]; normalise the map "
            "first: (cam - cam.min()) / (cam.max() - cam.min())"
        )
    return t


_SLACK = 1e-4  # rounding of a map normalised in float32 or resized


def _unit_range(img: torch.Tensor, dtype: Any) -> torch.Tensor:
    """An image as floats in [0, 1]: uint8 divided by 255; other integers refused; floats
    checked (a float image of 0-255 values, or one normalised by a mean and std, clamped to
    [0, 1], showed white or black)."""
    if dtype in (torch.uint8, np.uint8):
        return img.float() / 255.0
    if dtype in (torch.bool, np.bool_) or not img.is_floating_point():
        raise HookscopeError(
            f"overlay: an integer image must be uint8 (0-255), got {dtype}; convert it to "
            "uint8, or to floats in [0, 1]"
        )
    img = img.float()
    if not img.numel():
        return img
    lo, hi = float(img.min()), float(img.max())
    if lo < -_SLACK or hi > 1 + _SLACK or img.isnan().any():
        raise HookscopeError(
            f"overlay: a float image must hold values in [0, 1], got [{lo:.4g}, {hi:.4g}]; for "
            "0-255 values divide by 255 (or pass uint8), for a normalised image undo the "
            "normalisation (x * std + mean)"
        )
    return img


def overlay(image: Any, cam: Any, alpha: float = 0.5, colormap: str = "jet") -> Any:
    """Blend a CAM over an image: ``(1 - alpha) * image + alpha * colormap(cam)``.

    Args:
        image: a PIL image, a numpy array ``(H, W, 3)`` (uint8, or float in ``[0, 1]``), or a
            tensor ``(3, H, W)`` (uint8, as ``torchvision.io.read_image`` gives, or float in
            ``[0, 1]``). Grayscale is broadcast to RGB. A float image outside ``[0, 1]`` (0-255
            values, a normalised image) or another integer type raises :class:`HookscopeError`.
        cam: one map ``(h, w)`` in ``[0, 1]`` (tensor or array; ``(1, h, w)`` is accepted),
            resized bilinearly to the image when sizes differ. A map outside ``[0, 1]`` or with
            NaN raises :class:`HookscopeError` (normalise it first).
        alpha: opacity of the heatmap, in ``[0, 1]``.
        colormap: a matplotlib colormap name.

    Returns:
        The same kind as ``image``: a PIL RGB image, a uint8 array ``(H, W, 3)``, or a float tensor
        ``(3, H, W)`` in ``[0, 1]`` on the image's device.

    Example:
        >>> import numpy as np, torch, hookscope as hs
        >>> img = np.zeros((4, 4, 3), dtype=np.uint8)
        >>> out = hs.overlay(img, torch.ones(2, 2), alpha=1.0, colormap="gray")
        >>> out.shape, out.dtype, int(out.max())
        ((4, 4, 3), dtype('uint8'), 255)
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"overlay: alpha must be in [0, 1], got {alpha}")
    kind = (
        "tensor"
        if isinstance(image, torch.Tensor)
        else "array"
        if isinstance(image, np.ndarray)
        else "pil"
    )
    if kind == "pil":
        if not hasattr(image, "convert"):
            raise TypeError(
                f"overlay: image must be a PIL image, numpy array or tensor, got {type(image).__name__}"
            )
        img = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(
            2, 0, 1
        )
    elif kind == "array":
        arr = np.asarray(image)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
            raise HookscopeError(f"overlay: a numpy image must be (H, W, 3), got shape {arr.shape}")
        arr = arr[:, :, :3]
        if arr.dtype.kind not in "biuf":
            raise HookscopeError(f"overlay: a numpy image must hold numbers, got {arr.dtype}")
        dtype = arr.dtype.type
        img = _unit_range(torch.from_numpy(np.ascontiguousarray(arr)), dtype).permute(2, 0, 1)
    else:
        img = _unit_range(image.detach(), image.dtype)
        if img.ndim == 4 and img.shape[0] == 1:
            img = img[0]
        if img.ndim == 2:
            img = img[None]
        if img.ndim != 3 or img.shape[0] not in (1, 3):
            raise HookscopeError(
                f"overlay: a tensor image must be (3, H, W), got shape {tuple(image.shape)}"
            )
    if img.shape[0] == 1:
        img = img.expand(3, -1, -1)
    m = _as_map(cam).to(img.device)
    h, w = img.shape[1:]
    if tuple(m.shape) != (h, w):
        m = F.interpolate(m[None, None], size=(h, w), mode="bilinear", align_corners=False)[0, 0]
    lut = torch.from_numpy(_colormap_lut(colormap)).to(img.device)
    heat = lut[(m.clamp(0, 1) * 255).round().long()].permute(2, 0, 1)  # (3, H, W)
    out = ((1 - alpha) * img.clamp(0, 1) + alpha * heat).clamp(0, 1)
    if kind == "tensor":
        return out
    u8 = (out.permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    if kind == "array":
        return u8
    return _need("PIL.Image").fromarray(u8)


def feature_maps(
    activation: Any,
    max_channels: int = 64,
    order: Literal["energy", "index"] = "energy",
    normalize: Literal["channel", "global"] = "channel",
) -> Any:
    """A grid of a layer's channel maps as a matplotlib figure, each titled with its channel index.

    Args:
        activation: one sample's activation ``(C, H, W)`` (or ``(1, C, H, W)``), tensor or array.
        max_channels: show at most this many channels.
        order: ``"energy"``: the channels with the largest mean square first; ``"index"``: the
            first channels in order.
        normalize: ``"channel"``: each map scaled to its own min-max; ``"global"``: one scale for
            all shown maps (compare strengths across channels).

    Returns:
        a ``matplotlib.figure.Figure`` (not registered with pyplot); ``fig.savefig("maps.png")``.

    Raises:
        HookscopeError: the activation is not one sample's ``(C, H, W)``, or holds NaN or inf
            (no scale shows them; the message names the channels).

    Example:
        >>> import torch, hookscope as hs
        >>> fig = hs.feature_maps(torch.randn(6, 5, 5), max_channels=4, order="index")
        >>> [ax.get_title() for ax in fig.axes if ax.get_title()]
        ['0', '1', '2', '3']
    """
    if order not in ("energy", "index"):
        raise ValueError(f"feature_maps: order must be 'energy' or 'index', got {order!r}")
    if normalize not in ("channel", "global"):
        raise ValueError(
            f"feature_maps: normalize must be 'channel' or 'global', got {normalize!r}"
        )
    if max_channels < 1:
        raise ValueError(f"feature_maps: max_channels must be >= 1, got {max_channels}")
    a = (
        activation.detach()
        if isinstance(activation, torch.Tensor)
        else torch.as_tensor(np.asarray(activation))
    )
    a = a.float().cpu()
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 3:
        raise HookscopeError(
            f"feature_maps: expected one sample's activation (C, H, W), got shape {tuple(a.shape)}; "
            "pick a sample (activation[0]) of a convolutional layer"
        )
    c = a.shape[0]
    bad = ~a.isfinite()
    if bad.any():  # scaled to [0, 1] they drew blank (NaN) or flat maps (inf), without a word
        chans = bad.flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise HookscopeError(
            f"feature_maps: the activation holds {int(a.isnan().sum())} NaN and "
            f"{int(a.isinf().sum())} inf values (channel {', '.join(map(str, chans[:8]))}"
            f"{' ...' if len(chans) > 8 else ''}); a map to show must be finite: find where they "
            "start with hs.find_nonfinite(model, x)"
        )
    k = min(max_channels, c)
    if order == "energy":
        idx = a.pow(2).mean(dim=(1, 2)).argsort(descending=True, stable=True)[:k]
    else:
        idx = torch.arange(k)
    maps = a[idx]
    if normalize == "channel":
        lo = maps.amin(dim=(1, 2), keepdim=True)
        hi = maps.amax(dim=(1, 2), keepdim=True)
    else:
        lo, hi = maps.min(), maps.max()
    maps = (maps - lo) / (hi - lo).clamp_min(1e-12)
    figure = _need("matplotlib.figure")
    cols = math.ceil(math.sqrt(k))
    rows = math.ceil(k / cols)
    fig = figure.Figure(
        figsize=(1.6 * cols, 1.75 * rows), layout="constrained"
    )  # room for a suptitle
    for j in range(rows * cols):
        ax = fig.add_subplot(rows, cols, j + 1)
        ax.set_axis_off()
        if j < k:
            ax.imshow(maps[j].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(str(int(idx[j])), fontsize=8)
    return fig
