"""A model's repeated blocks (the transformer layers, the stages of a ResNet stage list).

A glob's ``*`` spans dots, so ``"transformer.h.*"`` selects every module under the blocks, not
the blocks. A sweep "over layers" needs exactly the repeated blocks: :func:`blocks` finds them
(the container whose children of one class hold the most parameters) and, given a child name,
that child of each block (``blocks(model, "attn")``).
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn

from ._compiled import named_modules, strip_compiled
from ._errors import LayerNotFoundError
from ._select import suggest

__all__ = ["blocks"]


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def blocks(model: nn.Module, child: str | None = None) -> dict[str, nn.Module]:
    """The repeated blocks of ``model`` as ``{name: module}``, in order; with ``child``, that
    submodule of every block (``"attn"`` gives ``{"transformer.h.0.attn": ..., ...}``).

    The blocks are the children of one class of a module (at least two of them, or any number
    for a ``ModuleList``/``Sequential`` of one class) that, among such modules, hold the most
    parameters.

    Raises:
        LayerNotFoundError: no module repeats in ``model``, or a block lacks ``child`` (the
            message lists the closest names under the first block).

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 4), nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)]))
        >>> list(hs.blocks(net))
        ['1.0', '1.1']
        >>> list(hs.blocks(net, "0"))
        ['1.0.0', '1.1.0']
    """
    modules = dict(named_modules(model))
    best: tuple[int, list[str]] = (-1, [])
    for name, m in modules.items():
        kids = list(m.named_children())
        counts = Counter(type(c) for _, c in kids)
        # a list of layers counts from one layer on (a 1-layer model); elsewhere two of a class
        least = 1 if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(counts) == 1 else 2
        for cls, n in counts.items():
            if n < least:
                continue
            same = [f"{name}.{k}" if name else k for k, c in kids if type(c) is cls]
            size = sum(_params(modules[s]) for s in same if s in modules)
            if size > best[0]:
                best = (size, [s for s in same if s in modules])
    if not best[1]:
        raise LayerNotFoundError(
            f"{type(strip_compiled(model)).__name__} has no repeated blocks (no module with two "
            "children of one class); select layers by name or glob instead"
        )
    names = best[1]
    if child is None:
        return {n: modules[n] for n in names}
    out = {}
    for n in names:
        full = f"{n}.{child}"
        if full not in modules:
            under = [k[len(n) + 1 :] for k in modules if k.startswith(n + ".")]
            close = suggest(child, under)
            raise LayerNotFoundError(
                f"block {n!r} has no submodule {child!r}; closest names under it: "
                + ", ".join(repr(c) for c in close)
            )
        out[full] = modules[full]
    return out
