"""Attention heads of any model: where a head's output lives, without a table per architecture.

Heads are not modules (docs/pitfalls.md §30): an attention module computes every head at once and mixes
them in its output projection (``c_proj`` in GPT-2, ``o_proj`` in Llama/Qwen2, ``dense`` in
GPT-NeoX and BERT, ``out_proj`` elsewhere). A head's output is therefore its slice of the *input*
of that projection: ``heads`` consecutive chunks of ``head_dim`` features. :func:`head_split`
finds the projection (a known name first, else the last Linear-like descendant, not named like a
query/key/value projection, whose input width is a multiple of the head count) and the head count (the module's own attributes, then its
``config``, then the model's), so grouped-query attention, where keys and values have fewer heads
than queries, is split by the query heads, as its output projection is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ._errors import HookscopeError

__all__ = ["HeadSplit", "HeadSplitError", "head_split", "in_features"]

PROJ_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "proj", "out", "o")
# query/key/value projections read the module's input, not the heads: never the output projection
_QKV = re.compile(
    r"(^|[._])(q|k|v|qk|kv|qkv|query|key|value|c_attn|query_key_value|in_proj|wqkv)(_proj)?$", re.I
)
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nhead")
_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size", "d_head")


class HeadSplitError(HookscopeError):
    """No output projection or head count could be found for an attention module; the message
    names the module and the argument that sets it."""


@dataclass(frozen=True)
class HeadSplit:
    """Where the heads of attention module ``layer`` are: the input of ``proj`` (its dotted name
    in the model), ``heads`` chunks of ``head_dim`` features along the last dimension."""

    layer: str
    proj: str
    module: nn.Module = field(repr=False)
    heads: int
    head_dim: int


def in_features(module: nn.Module) -> int | None:
    """The input width of a Linear-like module (``nn.Linear``, HF ``Conv1D``), else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and w is not None and w.ndim == 2:
        return int(w.shape[0])  # HF Conv1D stores (in, out)
    n = getattr(module, "in_features", None)
    return n if isinstance(n, int) and w is not None else None


def _int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _config_heads(obj: Any) -> int | None:
    cfg = getattr(obj, "config", None)
    if cfg is None:
        return None
    for n in ("num_attention_heads", "n_head", "n_heads", "num_heads"):
        v = getattr(cfg, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _count_heads(model: nn.Module, module: nn.Module, width: int) -> int | None:
    """The query-head count: the attention module's (or a descendant's) attributes, its config,
    the model's config."""
    for m in module.modules():
        h = _int_attr(m, _HEAD_ATTRS)
        if h is not None:
            return h
        d = _int_attr(m, _DIM_ATTRS)
        if d is not None and width % d == 0:
            return width // d
    return _config_heads(module) or _config_heads(model)


def head_split(
    model: nn.Module,
    name: str,
    module: nn.Module,
    *,
    heads: int | None = None,
    proj: str | None = None,
) -> HeadSplit:
    """Find the output projection and head count of the attention module ``name``.

    ``heads`` and ``proj`` (the projection's name relative to ``module``) override what is found.

    Raises:
        HeadSplitError: no Linear-like output projection under ``module``, or no head count that
            divides its input width; the message names ``module`` and the argument to pass.

    Example:
        >>> import torch.nn as nn
        >>> attn = nn.MultiheadAttention(8, num_heads=2)
        >>> s = head_split(attn, "", attn)
        >>> (s.proj, s.heads, s.head_dim)
        ('out_proj', 2, 4)
    """
    children = {n: m for n, m in module.named_modules() if n and in_features(m) is not None}
    shown = name or "<root>"
    if proj is not None:
        if proj not in children:
            raise HeadSplitError(
                f"head_proj={proj!r} is not a Linear-like module under {shown!r} "
                f"({type(module).__name__}); Linear-like modules there: {sorted(children) or 'none'}"
            )
        chosen = proj
    else:
        named = [n for n in children if n.rsplit(".", 1)[-1] in PROJ_NAMES]
        if len(named) > 1:
            raise HeadSplitError(
                f"{shown!r} ({type(module).__name__}) holds several output projections "
                f"({', '.join(map(repr, named))}): select the attention module itself, or name "
                "the one that mixes the heads with head_proj="
            )
        chosen = named[0] if named else ""
        if not chosen:
            n_guess = heads or _count_heads(model, module, 0) or 0
            fit = [
                n
                for n, m in children.items()
                if n_guess and in_features(m) % n_guess == 0 and not _QKV.search(n)
            ]
            chosen = fit[-1] if fit else ""
        if not chosen:
            raise HeadSplitError(
                f"{shown!r} ({type(module).__name__}) has no output projection named "
                f"{'/'.join(PROJ_NAMES[:4])} whose input holds the heads; name it with "
                f"head_proj= (Linear-like modules under it: {sorted(children) or 'none'}), or "
                "select the attention module that contains its output projection"
            )
    width = in_features(children[chosen])
    assert width is not None
    n = heads if heads is not None else _count_heads(model, module, width)
    if n is None:
        raise HeadSplitError(
            f"cannot tell how many heads {shown!r} ({type(module).__name__}) has: no num_heads / "
            "num_attention_heads / head_dim attribute and no config; pass n_heads="
        )
    if width % n:
        raise HeadSplitError(
            f"{shown!r}: the input of its output projection {chosen!r} has {width} features, "
            f"not a multiple of {n} heads; pass n_heads= (a divisor of {width}) or head_proj="
        )
    full = f"{name}.{chosen}" if name else chosen
    return HeadSplit(name, full, children[chosen], n, width // n)
