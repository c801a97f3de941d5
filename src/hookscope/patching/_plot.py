"""Heat map of a patching sweep: layers down, positions (token strings) or heads across."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..core._optional import need
from ._inputs import PatchingArgumentError

__all__ = ["plot_patching"]


def _token_labels(tokens: Any, tokenizer: Any) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        ids = tokens.flatten().tolist() if tokens.ndim <= 1 else tokens[0].tolist()
        if tokenizer is None:
            return [str(i) for i in ids]
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise PatchingArgumentError(
            f"plot_patching: tokens must be a list of strings or a tensor of token ids, got "
            f"{type(tokens).__name__} {tokens!r:.60}"
        )
    return [str(t) for t in tokens]


def _values(values: Any) -> torch.Tensor:
    """``values`` as a float32 CPU tensor; a one-line error for anything without a value."""
    if not isinstance(values, torch.Tensor):
        raise PatchingArgumentError(
            "plot_patching: values must be the tensor patch_sweep or attribution_patch returned, "
            f"got {type(values).__name__}"
        )
    if values.numel() == 0:
        raise PatchingArgumentError(
            f"plot_patching: values is empty (shape {tuple(values.shape)}): nothing to draw"
        )
    if values.is_complex():
        raise PatchingArgumentError("plot_patching: values must be real, got a complex tensor")
    return values.detach().to("cpu", torch.float32)


def plot_patching(
    values: torch.Tensor,
    layers: Sequence[str] | None = None,
    *,
    tokens: Any = None,
    tokenizer: Any = None,
    title: str | None = None,
    path: str | os.PathLike[str] | None = None,
    ax: Any = None,
) -> Any:
    """A heat map of a :func:`patch_sweep` or :func:`attribution_patch` result.

    Rows are the layers (``layers``: their names, e.g. ``list(hs.blocks(model))``); columns the
    positions (labelled by ``tokens``: strings, or token ids of one prompt turned into strings by
    ``tokenizer``) or the heads. A ``[layers, positions, heads]`` result gets one row per layer
    and head. Colours diverge around 0. Draws into ``ax`` (a matplotlib ``Axes``, e.g. from
    ``plt.subplots()``) or a new ``Figure`` on an Agg canvas (nothing shown); returns the figure
    and saves a PNG when ``path`` is given. NaN (the sites ``attribution_patch(top_k=)`` did not
    patch exactly) is drawn blank; the colour range is set by the finite values.

    Example:
        >>> import torch, hookscope as hs
        >>> fig = hs.plot_patching(torch.tensor([[0.0, 1.0], [-1.0, 0.5]]), ["h.0", "h.1"], tokens=["a", "b"])
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['a', 'b']
    """
    need("matplotlib", "viz", "plot_patching")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    v = _values(values)
    n_layers = v.shape[0] if v.ndim else 1
    if isinstance(layers, str):
        raise PatchingArgumentError(
            f"plot_patching: layers must be a list of layer names, got the str {layers!r}; "
            f"e.g. [{layers!r}] or list(hs.blocks(model))"
        )
    names = [str(n) for n in layers] if layers is not None else [str(i) for i in range(n_layers)]
    if len(names) != n_layers:
        raise PatchingArgumentError(
            f"plot_patching: {len(names)} layer names for a result of {n_layers} layers"
        )
    columns = "position"
    if v.ndim == 3:  # [layers, positions, heads] -> one row per layer and head
        heads = v.shape[2]
        names = [f"{n} h{h}" for n in names for h in range(heads)]
        v = v.permute(0, 2, 1).reshape(n_layers * heads, v.shape[1])
    elif v.ndim == 1:
        v = v[:, None]
        columns = ""
    elif v.ndim != 2:
        raise PatchingArgumentError(f"plot_patching: expected a result shaped [layers], [layers, x] or [layers, positions, heads]; got {tuple(v.shape)}")  # fmt: skip
    labels = _token_labels(tokens, tokenizer)
    if labels is not None and len(labels) != v.shape[1]:
        raise PatchingArgumentError(f"plot_patching: {len(labels)} tokens for {v.shape[1]} columns")
    if labels is None and v.shape[1] > 1:
        labels = [str(i) for i in range(v.shape[1])]
        columns = "position or head"
    finite = v[v.isfinite()]  # NaN: a site attribution_patch(top_k=) did not patch exactly
    lim = (float(finite.abs().max()) if finite.numel() else 0.0) or 1.0
    if ax is None:
        size = (max(4.0, 0.45 * v.shape[1] + 2.5), max(2.5, 0.3 * v.shape[0] + 1.5))
        fig = Figure(figsize=size)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    im = ax.imshow(v.numpy(), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_yticks(range(len(names)), names)
    if labels is not None:
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right")
    else:
        ax.set_xticks([])
    ax.set_xlabel(columns)
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
