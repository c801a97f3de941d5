"""A model's repeated blocks (the transformer layers, the stages of a ResNet stage list).

A glob's ``*`` spans dots, so ``"transformer.h.*"`` selects every module under the blocks, not
the blocks. A sweep "over layers" needs exactly the repeated blocks: :func:`blocks` finds them
(the container whose children of one class hold the most parameters; a ``ModuleList`` of layers
of several classes, a hybrid such as Jamba's Mamba and attention layers, counts whole) and, given
a child name, that child of each block (``blocks(model, "attn")``).

An encoder–decoder model (T5, BART) has two stacks of blocks: :func:`blocks` gives the blocks of
each, the encoder's then the decoder's (``within="decoder"`` asks for one stack). The stacks are
the model's ``get_encoder()``/``get_decoder()`` (Transformers), or, for any other model, two or
more same-class children that are not a list themselves and each hold a list of blocks.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch.nn as nn

from ._compiled import named_modules, strip_compiled
from ._errors import HookscopeWarning, LayerNotFoundError
from ._select import aliases, suggest

__all__ = ["blocks"]


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _list_like(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.Sequential))


def _best(modules: dict[str, nn.Module], within: str) -> tuple[str, list[str]]:
    """``(container, block names)``: the same-class children, under ``within``, holding the most
    parameters (at least two of them, or any number in a list of one class)."""
    best: tuple[int, str, list[str]] = (-1, "", [])
    under = within + "."
    for name, m in modules.items():
        if within and name != within and not name.startswith(under):
            continue
        kids = list(m.named_children())
        counts = Counter(type(c) for _, c in kids)
        # a list of layers counts from one layer on (a 1-layer model); elsewhere two of a class
        least = 1 if _list_like(m) and len(counts) == 1 else 2
        for cls, n in counts.items():
            if n < least:
                continue
            same = [f"{name}.{k}" if name else k for k, c in kids if type(c) is cls]
            same = [s for s in same if s in modules]
            size = sum(_params(modules[s]) for s in same)
            if size > best[0]:
                best = (size, name, same)
        # a ModuleList of layers of several classes (a hybrid: Jamba's Mamba and attention
        # layers) is one stack: all of it, not the layers of its largest class
        if isinstance(m, nn.ModuleList) and len(counts) > 1 and len(kids) > 1:
            same = [f"{name}.{k}" if name else k for k, _ in kids]
            sizes = [_params(modules[s]) if s in modules else 0 for s in same]
            if all(sizes) and sum(sizes) > best[0]:
                best = (sum(sizes), name, same)
    return best[1], best[2]


def _stacks(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """The names of an encoder–decoder model's stacks (empty: one stack)."""
    root = strip_compiled(model)
    if getattr(getattr(root, "config", None), "is_encoder_decoder", False):
        found = []
        for getter in ("get_encoder", "get_decoder"):
            fn = getattr(root, getter, None)
            sub = fn() if callable(fn) else None
            name = next((n for n, m in modules.items() if m is sub and n), None)
            if name is not None:
                found.append(name)
        if len(found) == 2 and found[0] != found[1]:
            return found
    container, names = _best(modules, "")
    if not names or _list_like(modules[container]) or any(_list_like(modules[n]) for n in names):
        return []
    inner = [_best(modules, n) for n in names]
    if all(c and _list_like(modules[c]) and b for c, b in inner):
        return names
    return []


def _warn_shared(model: nn.Module, names: list[str]) -> None:
    """A block registered under several names (``nn.ModuleList([blk, blk, blk])``, ALBERT-style
    sharing) is one module: ``named_children`` lists it once, so the blocks read as fewer than
    the model runs. Said, not dropped without a word."""
    seconds: dict[str, list[str]] = {}
    for second, first in aliases(model).items():
        if first in names:
            seconds.setdefault(first, []).append(second)
    if not seconds:
        return
    shown = "; ".join(
        f"{first!r} is one module under {len(more) + 1} names ({', '.join(map(repr, [first, *more]))})"
        for first, more in seconds.items()
    )
    warnings.warn(
        f"blocks: {shown}: listed once, under its first name; its hooks see all its calls, in "
        "the order they run, so a sweep over these blocks sees it as one block",
        HookscopeWarning,
        stacklevel=3,
    )


def blocks(
    model: nn.Module, child: str | None = None, *, within: str | None = None
) -> dict[str, nn.Module]:
    """The repeated blocks of ``model`` as ``{name: module}``, in order; with ``child``, that
    submodule of every block (``"attn"`` gives ``{"transformer.h.0.attn": ..., ...}``).

    The blocks are the children of one class of a module (at least two of them, or any number
    for a ``ModuleList``/``Sequential`` of one class), or every child of a ``ModuleList`` of
    several classes that all hold parameters (a hybrid stack: Jamba), that, among such modules,
    hold the most parameters. An encoder–decoder model gives the blocks of both stacks, the
    encoder's first (``encoder.block.0``, ..., ``decoder.block.0``, ...); ``within="decoder"``
    (any submodule name) looks only under that module, names staying those of ``model``.

    Raises:
        LayerNotFoundError: no module repeats in ``model`` (or under ``within``), or a block lacks
            ``child`` (the message lists the closest names under the first block).

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 4), nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)]))
        >>> list(hs.blocks(net))
        ['1.0', '1.1']
        >>> list(hs.blocks(net, "0"))
        ['1.0.0', '1.1.0']
        >>> list(hs.blocks(net, within="1"))  # only under module "1" (one stack of several)
        ['1.0', '1.1']
    """
    modules = dict(named_modules(model))
    if within is not None and within not in modules:
        close = suggest(within, [n for n in modules if n])
        raise LayerNotFoundError(
            f"blocks(within={within!r}): no such submodule; closest names: "
            + ", ".join(repr(c) for c in close)
        )
    stacks = [] if within is not None else _stacks(model, modules)
    names: list[str] = []
    for stack in stacks or [within or ""]:
        names += _best(modules, stack)[1]
    if not names:
        where = f" under {within!r}" if within else ""
        raise LayerNotFoundError(
            f"{type(strip_compiled(model)).__name__} has no repeated blocks{where} (no module "
            "with two children of one class); select layers by name or glob instead"
        )
    _warn_shared(model, names)
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
                + (
                    f" (the blocks span {len(stacks)} stacks, {', '.join(map(repr, stacks))}: "
                    "within= picks one)"
                    if stacks
                    else ""
                )
            )
        out[full] = modules[full]
    return out
