"""The CAM methods: each says how an activation ``a`` ``(B, C, *spatial)`` and its gradient ``g``
become a map; everything else (forward, backward, targets, tokens, normalising, upsampling) is
the template in ``_base.py``. Formulas follow the papers and pytorch-grad-cam's implementations,
against which the tests compare values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core._nested import map_tensors
from ..core._progress import progress_bar
from ._base import CAM, CAMError, _Run
from ._tokens import Reshape

__all__ = ["EigenCAM", "GradCAM", "GradCAMPlusPlus", "HiResCAM", "LayerCAM", "ScoreCAM", "XGradCAM"]


def _spatial(a: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, a.ndim))


class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): channel weights are the spatial mean of the gradient.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2)).eval()
        >>> cam = hs.GradCAM(net, "0")(torch.randn(2, 3, 8, 8), target=1)
        >>> cam.shape, bool(cam.min() >= 0), bool(cam.max() <= 1)
        (torch.Size([2, 8, 8]), True, True)
    """

    name = "gradcam"

    def channel_weights(self, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        assert g is not None
        return g.mean(dim=_spatial(g))


class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhay et al. 2018, eq. 19): higher-order gradient weighting.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).
    """

    name = "gradcam++"
    aliases = ("gradcamplusplus",)

    def channel_weights(self, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        assert g is not None
        dims = _spatial(a)
        g2 = g * g
        g3 = g2 * g
        sum_a = a.sum(dim=dims, keepdim=True)
        aij = g2 / (2 * g2 + sum_a * g3 + 1e-6)
        aij = torch.where(g != 0, aij, torch.zeros_like(aij))
        return (g.clamp_min(0) * aij).sum(dim=dims)


class XGradCAM(CAM):
    """XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activation.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).
    """

    name = "xgradcam"

    def channel_weights(self, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        assert g is not None
        dims = _spatial(a)
        return (g * a / (a.sum(dim=dims, keepdim=True) + 1e-7)).sum(dim=dims)


class HiResCAM(CAM):
    """HiResCAM (Draelos & Carin 2020): element-wise gradient x activation, summed over channels.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).
    """

    name = "hirescam"

    def layer_map(self, a: torch.Tensor, g: torch.Tensor | None, run: _Run) -> torch.Tensor:
        assert g is not None
        return (g * a).sum(dim=1)


class LayerCAM(CAM):
    """LayerCAM (Jiang et al. 2021): positive gradients x activation, element-wise.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).
    """

    name = "layercam"

    def layer_map(self, a: torch.Tensor, g: torch.Tensor | None, run: _Run) -> torch.Tensor:
        assert g is not None
        return (g.clamp_min(0) * a).sum(dim=1)


class EigenCAM(CAM):
    """EigenCAM (Muhammad & Yeasin 2020): projection on the first principal component; no gradient.

    The forward pass stops at the layer's first call: a layer called again later in the forward
    (a module reused) is read at that first call, not refused as by the other methods. The SVD's
    sign is arbitrary; hookscope fixes it so that the larger magnitude is positive (Seg-Eigen-CAM
    eq. 13), making maps reproducible across devices and LAPACK builds. ``torch.linalg.svd`` synchronises with the host on CUDA.

    Takes the arguments of :class:`CAM` (``model, layer, reshape, relu, raw``).
    """

    name = "eigencam"
    uses_gradients = False
    needs_target = False

    def layer_map(self, a: torch.Tensor, g: torch.Tensor | None, run: _Run) -> torch.Tensor:
        flat = a.flatten(2).transpose(1, 2)  # (B, positions, C)
        flat = flat - flat.mean(dim=1, keepdim=True)
        _, _, vh = torch.linalg.svd(flat, full_matrices=False)
        proj = flat @ vh[:, 0, :, None]  # (B, positions, 1)
        proj = proj.squeeze(2)
        flip = proj.amin(dim=1).abs() > proj.amax(dim=1).abs()
        proj = torch.where(flip[:, None], -proj, proj)
        return proj.reshape(a.shape[0], *a.shape[2:])


def _check_rowwise(run: _Run, out: Any, s: torch.Tensor) -> None:
    """A target function must score each row of a masked batch on its own: ScoreCAM hands it
    masked copies of one sample, so a function picking a class per sample of the batch
    (``out[range(B), classes]``) scored a copy against another sample's class whenever a batch
    of copies had B rows, and one relative to the batch (``out[:, k] - out[:, k].mean()``)
    scored it against the other copies, silently. Its scores of the rows reversed must be its
    scores reversed, and of the first row alone its first score (one host sync per call)."""
    n = s.shape[0]

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return got.shape == want.shape and torch.allclose(
            got.float(), want.float(), rtol=1e-5, atol=1e-6, equal_nan=True
        )

    rows = lambda pick: map_tensors(lambda t: pick(t) if t.ndim and t.shape[0] == n else t, out)  # noqa: E731
    try:
        ok = same(run.score(rows(lambda t: t.flip(0))).flip(0), s) and same(
            run.score(rows(lambda t: t[:1])), s[:1]
        )
    except (RuntimeError, IndexError, ValueError, TypeError):  # e.g. indices for B rows, given 1
        ok = False
    if not ok:
        raise CAMError(
            "ScoreCAM: the target function scores the rows of a batch by their position or "
            "against each other (the rows reversed, or the first row alone, got other scores); "
            "ScoreCAM calls it on the outputs of masked copies of one sample, not on the batch, "
            "so a function picking a class per sample (out[range(B), classes]) scores copies "
            "against other samples' classes. Pass target=[class per sample], or a function "
            "scoring each row on its own (target=lambda out: out[:, k])"
        )


class ScoreCAM(CAM):
    """Score-CAM (Wang et al. 2020): each channel's weight is the target score of the input masked
    by that (upsampled, min-max normalised) channel, softmaxed over channels. No gradient.

    Costs one forward per channel and sample, run ``batch_size`` masked inputs at a time under
    ``no_grad``: memory stays bounded by ``batch_size`` forwards whatever the channel count.
    Masks are upsampled with ``align_corners=True`` as in the reference implementation. A target
    function is called on the outputs of masked copies of one sample, so it must score each row
    alike (``lambda out: out[:, k]``; per-sample classes: ``target=[...]``): it is checked once
    per call on one masked batch, its rows reversed and its first row alone (one host sync), and
    refused otherwise. A progress bar counts the masked batches (tqdm: a widget in Jupyter, a bar
    on a terminal, nothing when stderr is not a terminal; removed when done).

    Args:
        model, layer, reshape, relu, raw: as for :class:`CAM`.
        batch_size: masked inputs per forward pass (bounds the memory).
        progress: show the progress bar (``False``: never).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2)).eval()
        >>> hs.ScoreCAM(net, "0", batch_size=2, progress=False)(torch.randn(1, 3, 8, 8), target=0).shape
        torch.Size([1, 8, 8])
    """

    name = "scorecam"
    uses_gradients = False

    def __init__(
        self,
        model: nn.Module,
        layer: Any,
        reshape: Reshape = None,
        *,
        relu: bool = True,
        raw: bool = False,
        batch_size: int = 32,
        progress: bool = True,
    ) -> None:
        super().__init__(model, layer, reshape, relu=relu, raw=raw)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.progress = progress

    def channel_weights(
        self, a: torch.Tensor, g: torch.Tensor | None
    ) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError("ScoreCAM needs the model: see layer_map")

    def layer_map(self, a: torch.Tensor, g: torch.Tensor | None, run: _Run) -> torch.Tensor:
        x = run.x
        size = tuple(x.shape[2:])
        mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[a.ndim - 2]
        b, c = a.shape[:2]
        scores = torch.empty(b, c, device=a.device, dtype=torch.float32)
        chunks = -(-c // self.batch_size)
        bar = progress_bar(
            b * chunks, desc="ScoreCAM", unit="batch", enabled=self.progress, leave=False
        )
        unchecked = callable(run.target)  # a target function: checked once it sees 2+ rows
        with torch.no_grad(), bar:
            for i in range(b):
                rows = None if run.index is None else run.index[i : i + 1]
                for c0 in range(0, c, self.batch_size):
                    chunk = a[i, c0 : c0 + self.batch_size].unsqueeze(1)  # (n, 1, *spatial)
                    up = F.interpolate(chunk, size=size, mode=mode, align_corners=True)
                    dims = tuple(range(1, up.ndim))
                    lo, hi = up.amin(dim=dims, keepdim=True), up.amax(dim=dims, keepdim=True)
                    masks = (up - lo) / (hi - lo + 1e-8)
                    masked = x[i : i + 1] * masks.to(x.dtype)  # (n, C_in, *spatial)
                    out = run.model(masked)
                    r = None if rows is None else rows.expand(masked.shape[0])
                    s = run.score(out, r)
                    if s.shape != (masked.shape[0],):
                        raise CAMError(
                            f"ScoreCAM scores {masked.shape[0]} masked copies of a sample at a time: the target "
                            f"function must return one score per row, shape ({masked.shape[0]},); got {tuple(s.shape)}"
                        )
                    if unchecked and masked.shape[0] > 1:
                        unchecked = False
                        _check_rowwise(run, out, s)
                    scores[i, c0 : c0 + masked.shape[0]] = s.float()
                    bar.update(1)
        w = scores.softmax(dim=1)
        return (w.view(b, c, *([1] * (a.ndim - 2))) * a).sum(dim=1)
