"""Turning a layer's activation into a spatial grid ``(B, C, *spatial)`` for CAM methods.

Convolutional layers already give ``(B, C, H, W)``. Transformers give tokens ``(B, N, C)`` (ViT,
DeiT) or channels-last grids ``(B, H, W, C)`` (Swin in torchvision and timm). :func:`to_grid`
recognises these when the answer is unambiguous and otherwise raises :class:`ReshapeError`
asking for ``reshape=``.

Rules, given the input image's height ``H`` and width ``W``:

* 3-D ``(B, N, C)``: tokens. A grid ``h x w`` with ``h * W == w * H`` (the image's aspect ratio)
  must account for all ``N`` tokens, or for ``N - 1`` (a leading class token, dropped). Exactly
  one such grid must exist; otherwise (register or distillation tokens, unusual aspect ratios)
  pass ``reshape=(h, w)`` (keep the last ``h * w`` tokens) or a function.
* 4-D: ``(B, C, h, w)`` unless only the channels-last reading ``(B, h, w, C)`` has the image's
  aspect ratio (within 15%), which is then permuted.
* anything else with at least one spatial dim is used as ``(B, C, *spatial)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..core._errors import HookscopeError

__all__ = ["Reshape", "ReshapeError", "to_grid"]

Reshape = Callable[[torch.Tensor], torch.Tensor] | tuple[int, int] | None
"""``None`` (automatic), a grid ``(h, w)`` (the last ``h * w`` tokens of ``(B, N, C)``), or a
function ``fn(activation) -> (B, C, h, w)`` applied to activations and gradients alike."""


class ReshapeError(HookscopeError):
    """A layer's activation cannot be turned into a spatial grid without ``reshape=``."""


def _aspect_ok(h: int, w: int, hw: tuple[int, int] | None, tol: float = 0.0) -> bool:
    if hw is None:
        return h == w
    H, W = hw
    if tol == 0.0:
        return h * W == w * H
    return abs(h * W - w * H) <= tol * max(h * W, w * H)


def _token_grids(n: int, hw: tuple[int, int] | None) -> list[tuple[int, int, int]]:
    """Candidate ``(prefix, h, w)`` for ``n`` tokens with 0 or 1 leading tokens."""
    found = []
    for prefix in (0, 1):
        m = n - prefix
        if m <= 0:
            continue
        for h in range(1, math.isqrt(m) + 1):
            if m % h:
                continue
            for hh, ww in {(h, m // h), (m // h, h)}:
                if _aspect_ok(hh, ww, hw):
                    found.append((prefix, hh, ww))
    return found


def to_grid(
    t: torch.Tensor,
    reshape: Reshape = None,
    *,
    image_hw: tuple[int, int] | None = None,
    layer: str = "",
) -> torch.Tensor:
    """Return ``t`` as ``(B, C, *spatial)``; see the module docstring for the rules.

    Example:
        >>> import torch
        >>> to_grid(torch.zeros(2, 1 + 4 * 4, 8), image_hw=(64, 64)).shape  # class token dropped
        torch.Size([2, 8, 4, 4])
        >>> to_grid(torch.zeros(2, 7, 7, 96), image_hw=(224, 224)).shape  # Swin, channels-last
        torch.Size([2, 96, 7, 7])
    """
    where = f"layer {layer!r}" if layer else "the layer"
    if callable(reshape):
        out = reshape(t)
        if not isinstance(out, torch.Tensor) or out.ndim < 3:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ReshapeError(f"reshape= for {where} must return a (B, C, h, w) tensor, got {got}")
        return out
    if reshape is not None:
        h, w = (int(v) for v in reshape)
        if t.ndim != 3 or t.shape[1] < h * w:
            raise ReshapeError(
                f"reshape=({h}, {w}) needs tokens (B, N, C) with N >= {h * w}; {where} gave {tuple(t.shape)}"
            )
        return t[:, t.shape[1] - h * w :].transpose(1, 2).reshape(t.shape[0], t.shape[2], h, w)
    if t.ndim == 3:
        n = t.shape[1]
        grids = _token_grids(n, image_hw)
        if len(grids) == 1:
            prefix, h, w = grids[0]
            return t[:, prefix:].transpose(1, 2).reshape(t.shape[0], t.shape[2], h, w)
        why = "several grids fit" if grids else "no grid with the image's aspect ratio fits"
        cand = ", ".join(f"{h}x{w}" + (" after a class token" if p else "") for p, h, w in grids)
        raise ReshapeError(
            f"{where} gives tokens {tuple(t.shape)} (B, N, C) and {why} {n} tokens"
            + (f" ({cand})" if cand else "")
            + "; pass reshape=(h, w) to keep the last h*w tokens as an h x w grid, "
            "or reshape=fn returning (B, C, h, w)"
        )
    if t.ndim == 4:
        nchw = _aspect_ok(t.shape[2], t.shape[3], image_hw, 0.15)
        nhwc = _aspect_ok(t.shape[1], t.shape[2], image_hw, 0.15)
        if nhwc and not nchw:
            return t.permute(0, 3, 1, 2)
        return t
    if t.ndim < 3:
        raise ReshapeError(
            f"{where} gives {tuple(t.shape)}, which has no spatial dimensions; pick a convolutional or "
            "token layer (CAM needs a map), or pass reshape=fn returning (B, C, h, w)"
        )
    return t
