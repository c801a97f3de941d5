"""Heat map of a patching sweep: layers down, positions (token strings) or heads across."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..core._optional import need

__all__ = ["plot_patching"]


def _token_labels(tokens: Any, tokenizer: Any) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        ids = tokens.flatten().tolist() if tokens.ndim <= 1 else tokens[0].tolist()
        if tokenizer is None:
            return [str(i) for i in ids]
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return [str(t) for t in tokens]


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
    and saves a PNG when ``path`` is given.

    Example:
        >>> import torch, hookscope as hs
        >>> fig = hs.plot_patching(torch.tensor([[0.0, 1.0], [-1.0, 0.5]]), ["h.0", "h.1"], tokens=["a", "b"])
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['a', 'b']
    """
    need("matplotlib", "viz", "plot_patching")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    v = values.detach().to("cpu", torch.float32)
    n_layers = v.shape[0] if v.ndim else 1
    names = list(layers) if layers is not None else [str(i) for i in range(n_layers)]
    if len(names) != n_layers:
        raise ValueError(f"{len(names)} layer names for a result of {n_layers} layers")
    columns = "position"
    if v.ndim == 3:  # [layers, positions, heads] -> one row per layer and head
        heads = v.shape[2]
        names = [f"{n} h{h}" for n in names for h in range(heads)]
        v = v.permute(0, 2, 1).reshape(n_layers * heads, v.shape[1])
    elif v.ndim == 1:
        v = v[:, None]
        columns = ""
    elif v.ndim != 2:
        raise ValueError(f"expected a result shaped [layers], [layers, x] or [layers, positions, heads]; got {tuple(v.shape)}")  # fmt: skip
    labels = _token_labels(tokens, tokenizer)
    if labels is not None and len(labels) != v.shape[1]:
        raise ValueError(f"{len(labels)} tokens for {v.shape[1]} columns")
    if labels is None and v.shape[1] > 1:
        labels = [str(i) for i in range(v.shape[1])]
        columns = "position or head"
    lim = float(v.abs().max()) or 1.0
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
