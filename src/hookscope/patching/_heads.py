"""Attention heads of any model: where a head's output lives, without a table per architecture.

Heads are not modules (docs/pitfalls.md §30): an attention module computes every head at once and mixes
them in its output projection (``c_proj`` in GPT-2, ``o_proj`` in Llama/Qwen2, ``dense`` in
GPT-NeoX and BERT, ``out_proj`` elsewhere). A head's output is therefore its slice of the *input*
of that projection: ``heads`` consecutive chunks of ``head_dim`` features. :func:`head_split`
finds the projection (a known name first, else the last Linear-like descendant, not named like a
query/key/value projection, whose input width is a multiple of the head count) and the head
count the module itself declares (a head-count or head-width attribute on it or a submodule), so
grouped-query attention, where keys and values have fewer heads than queries, is split by the
query heads, as its output projection is. A module that declares no heads (an MLP) is refused
unless ``n_heads=`` says it has them; an ``n_heads=`` that contradicts the module is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..core._errors import HookscopeError

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


def declared_heads(module: nn.Module, width: int) -> tuple[int, str] | None:
    """The query-head count that ``module`` (or a submodule) declares, and the attribute that
    says it: a head-count attribute, or a head width dividing ``width`` (the input width of its
    output projection). ``None`` where nothing declares heads (an MLP): a config's head count is
    the model's, not this module's, so it is never read."""
    for name, m in module.named_modules():
        where = f"{name}." if name else ""
        for attr in _HEAD_ATTRS:
            h = _int_attr(m, (attr,))
            if h is not None:
                return h, f"{where}{attr}={h}"
        for attr in _DIM_ATTRS:
            d = _int_attr(m, (attr,))
            if d is not None and width and width % d == 0:
                return width // d, f"{where}{attr}={d}"
    return None


def _check_count(heads: Any) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise HeadSplitError(
            f"n_heads must be a positive number of attention heads, got {heads!r}; leave it out "
            "to use the count the attention module declares"
        )


def _projection(module: nn.Module, shown: str, proj: str | None, heads: int | None) -> str:
    """The name (under ``module``) of the Linear-like output projection whose input holds the
    heads: ``proj``, else one named like an output projection, else the last one (not a
    query/key/value projection) whose input width the head count divides."""
    children = {n: m for n, m in module.named_modules() if n and in_features(m) is not None}
    if proj is not None:
        if proj not in children:
            raise HeadSplitError(
                f"head_proj={proj!r} is not a Linear-like module under {shown!r} "
                f"({type(module).__name__}); Linear-like modules there: {sorted(children) or 'none'}"
            )
        return proj
    named = [n for n in children if n.rsplit(".", 1)[-1] in PROJ_NAMES]
    if len(named) > 1:
        raise HeadSplitError(
            f"{shown!r} ({type(module).__name__}) holds several output projections "
            f"({', '.join(map(repr, named))}): select the attention module itself, or name "
            "the one that mixes the heads with head_proj="
        )
    if named:
        return named[0]

    def fits(m: nn.Module) -> bool:
        width = in_features(m) or 0
        n = heads or (declared_heads(module, width) or (0, ""))[0]
        return bool(n) and width % n == 0

    fit = [n for n, m in children.items() if not _QKV.search(n) and fits(m)]
    if fit:
        return fit[-1]
    raise HeadSplitError(
        f"{shown!r} ({type(module).__name__}) has no output projection named "
        f"{'/'.join(PROJ_NAMES[:4])} whose input holds the heads; name it with "
        f"head_proj= (Linear-like modules under it: {sorted(children) or 'none'}), or "
        "select the attention module that contains its output projection"
    )


def head_split(
    name: str,
    module: nn.Module,
    *,
    heads: int | None = None,
    proj: str | None = None,
) -> HeadSplit:
    """Find the output projection and head count of the attention module ``name``.

    ``proj`` (the projection's name relative to ``module``) overrides what is found; ``heads``
    sets the head count of a module that declares none, and must equal the count it declares
    otherwise.

    Raises:
        HeadSplitError: no Linear-like output projection under ``module``; a module that declares
            no heads (an MLP) without ``heads``; ``heads`` not a positive int, not what the module
            declares, or not dividing the projection's input width. The message names ``module``
            and the argument to pass.

    Example:
        >>> import torch.nn as nn
        >>> attn = nn.MultiheadAttention(8, num_heads=2)
        >>> s = head_split("", attn)
        >>> (s.proj, s.heads, s.head_dim)
        ('out_proj', 2, 4)
    """
    if heads is not None:
        _check_count(heads)
    shown = name or "<root>"
    chosen = _projection(module, shown, proj, heads)
    projection = module.get_submodule(chosen)
    width = in_features(projection)
    assert width is not None  # a Linear-like module
    declared = declared_heads(module, width)
    if heads is None:
        if declared is None:
            raise HeadSplitError(
                f"{shown!r} ({type(module).__name__}) declares no attention heads (no "
                f"{' / '.join(_HEAD_ATTRS[:3])} / head_dim attribute on it or its submodules), "
                "so its input has no heads to split: select attention modules (e.g. "
                "hs.blocks(model, 'attn')), or pass n_heads= if this module does compute heads"
            )
        heads = declared[0]
    elif declared is not None and declared[0] != heads:
        raise HeadSplitError(
            f"n_heads={heads} but {shown!r} ({type(module).__name__}) declares {declared[0]} "
            f"heads ({declared[1]}); leave n_heads out or pass n_heads={declared[0]}"
        )
    if width % heads:
        raise HeadSplitError(
            f"{shown!r}: the input of its output projection {chosen!r} has {width} features, "
            f"not a multiple of {heads} heads; pass n_heads= (a divisor of {width}) or head_proj="
        )
    full = f"{name}.{chosen}" if name else chosen
    return HeadSplit(name, full, projection, heads, width // heads)
