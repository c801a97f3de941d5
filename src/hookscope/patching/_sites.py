"""What a sweep patches: for each selected layer (a :class:`PatchedLayer`), where its activation is
read and written (the layer's output or input, or the input of its output projection for heads),
how it is cut into sites (a site is one position, one head, one head at one position, or the
whole activation), and where batched rows start."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._blocks import blocks
from ..core._compiled import strip_compiled
from ..core._edit import positional_index
from ..core._errors import LayerNotFoundError
from ..core._nested import first_tensor, iter_tensors, map_tensors, replace_first
from ..core._select import find, resolve
from ._heads import HeadSplit, head_split
from ._inputs import PatchingArgumentError, PatchingError

__all__ = [
    "OVER",
    "PatchedLayer",
    "first_positions",
    "get_act",
    "grid",
    "patched",
    "per_site",
    "resolve_layers",
    "set_act",
    "site_masks",
    "stack_layers",
    "view",
]

OVER = ((), ("position",), ("head",), ("position", "head"))


@dataclass
class PatchedLayer:
    """One selected layer of a sweep (its sites are cut from its activation by ``over``)."""

    name: str  # the layer as selected
    point: str  # the module whose input/output holds the activation
    kind: Literal["input", "output"]
    arg: int | str | None
    heads: HeadSplit | None
    start: str  # where the batched rows start (FanOut)
    start_at: Literal["input", "output"]


def _check_over(over: Sequence[str]) -> tuple[str, ...]:
    if isinstance(over, str):
        over = (over,)
    try:
        t = tuple(over)
    except TypeError:
        t = over  # not a sequence: refused below
    if t not in OVER:
        raise PatchingError(
            f"over={t!r} is not a sweep this supports; valid: "
            + ", ".join(repr(o) for o in OVER)
            + " (positions before heads)"
        )
    return t


def names_of_blocks(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks (``hs.blocks``), or ``[]`` when it has none."""
    try:
        return list(blocks(model))
    except LayerNotFoundError:
        return []


def _in_order(model: nn.Module, layers: Any) -> dict[str, nn.Module]:
    """The selected layers in the order of the result's rows: a list (or a dict's keys) in the
    order given, each selector's layers (a glob, a type) in the model's order at its place; one
    selector in the model's order. A layer selected twice is refused: the result has one row
    per layer, so it would be merged into one row and the rows would no longer match the list."""
    one = isinstance(layers, (str, bytes, type, nn.Module, torch.Tensor))
    if not one and isinstance(layers, Iterable):
        layers = list(layers)  # a generator is read once
    chosen = resolve(model, layers)  # the checks and messages of every layers= argument
    if not isinstance(layers, list):
        return chosen
    ordered: dict[str, nn.Module] = {}
    for sel in layers:
        for name, module in find(model, sel).items():
            if name in ordered:
                raise PatchingArgumentError(
                    f"layers selects {name!r} twice (again by {sel!r}); the result has one row "
                    "per layer, in the order of the list: select each layer once"
                )
            ordered[name] = module
    return ordered


def resolve_layers(
    model: nn.Module,
    layers: Any,
    *,
    at: str,
    over: Sequence[str],
    arg: int | str | None,
    n_heads: int | None,
    head_proj: str | None,
) -> tuple[list[PatchedLayer], tuple[str, ...], list[str]]:
    """The selected layers of a sweep in the order of the result's rows (:func:`_in_order`), the
    normalised ``over``, and the model's repeated blocks (the sweep's job needs them too: found
    once)."""
    over_t = _check_over(over)
    if at not in ("output", "input"):
        raise PatchingError(f"at must be 'output' or 'input', got {at!r}")
    chosen = _in_order(model, layers)
    names = list(chosen)
    nested = [(a, b) for a in names for b in names if a != b and b.startswith(a + ".")]
    if nested:
        a, b = nested[0]
        raise PatchingError(
            f"the layers mix nesting levels: {a!r} contains {b!r} ({len(chosen)} layers "
            "selected; a glob's '*' spans dots). Select the repeated blocks with "
            "hs.blocks(model), or one child of each with hs.blocks(model, 'attn')"
        )
    block_names = names_of_blocks(model)
    found = []
    for name in names:
        module = chosen[name]
        outer = next((b for b in block_names if name.startswith(b + ".")), None)
        if "head" in over_t:
            if at != "output":
                raise PatchingError(
                    "a head sweep patches each head's slice of the input of the attention "
                    "module's output projection; leave at='output'"
                )
            split = head_split(name, module, heads=n_heads, proj=head_proj)
            start = outer or name
            found.append(PatchedLayer(name, split.proj, "input", None, split, start, "input"))
        else:
            if outer is not None:
                found.append(PatchedLayer(name, name, at, arg, None, outer, "input"))  # type: ignore[arg-type]
            else:
                found.append(PatchedLayer(name, name, at, arg, None, name, at))  # type: ignore[arg-type]
    return found, over_t, block_names


def _input_slot(
    layer: PatchedLayer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, Any]:
    """Where the activation is among a call's inputs: ``("arg", i)`` or ``("kw", name)``."""
    arg = layer.arg
    if isinstance(arg, str):
        if arg in kwargs:
            return "kw", arg
        i = positional_index(strip_compiled(module), arg)
        if i is not None and i < len(args):
            return "arg", i
    elif isinstance(arg, int):
        if arg < len(args):
            return "arg", arg
    else:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return "arg", i
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return "kw", "hidden_states"
    given = [f"{len(args)} positional"] + [repr(k) for k in kwargs]
    wanted = "a tensor input or 'hidden_states'" if arg is None else f"input {arg!r}"
    raise PatchingError(
        f"at='input' on {layer.point!r}: the call has no {wanted}; it got {', '.join(given)}. "
        "Pass arg= with a positional index or a keyword name"
    )


def get_act(
    layer: PatchedLayer, module: nn.Module, args: Any, kwargs: Any, output: Any = None
) -> torch.Tensor:
    """The activation of ``layer`` in a call (the output's first tensor, or the input)."""
    if layer.kind == "output":
        t = first_tensor(output)
        if t is None:
            raise PatchingError(f"layer {layer.point!r} returned no tensor to patch")
        return t
    where, key = _input_slot(layer, module, args, kwargs)
    value = args[key] if where == "arg" else kwargs[key]
    t = first_tensor(value)
    if t is None:
        raise PatchingError(f"input {key!r} of {layer.point!r} holds no tensor to patch")
    return t


def set_act(
    layer: PatchedLayer,
    module: nn.Module,
    args: Any,
    kwargs: Any,
    output: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> Any:
    """The call's output (``kind="output"``) or ``(args, kwargs)`` with the activation replaced
    by ``fn(activation)``."""
    if layer.kind == "output":
        if isinstance(output, torch.Tensor):
            return fn(output)
        first = next(iter(iter_tensors(output)))[1]
        return map_tensors(lambda t: fn(t) if t is first else t, output)
    where, key = _input_slot(layer, module, args, kwargs)
    if where == "arg":
        args = list(args)
        args[key] = replace_first(args[key], fn)
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    kwargs[key] = replace_first(kwargs[key], fn)
    return args, kwargs


def grid(layer: PatchedLayer, over: tuple[str, ...], act_shape: torch.Size) -> tuple[int, ...]:
    """The sizes of the sweep axes of ``layer`` for an activation of ``act_shape`` (batch first)."""
    sizes = []
    for axis in over:
        if axis == "position":
            if len(act_shape) < 3:
                raise PatchingError(
                    f"over='position' needs an activation shaped (batch, position, ...); "
                    f"{layer.point!r} gives {tuple(act_shape)}"
                )
            sizes.append(int(act_shape[1]))
        else:
            assert layer.heads is not None
            sizes.append(layer.heads.heads)
    return tuple(sizes)


def view(layer: PatchedLayer, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the heads split out of its last dimension (``(..., heads, head_dim)``)."""
    if layer.heads is None:
        return t
    h = layer.heads
    if t.shape[-1] != h.heads * h.head_dim:
        raise PatchingError(
            f"the input of {h.proj!r} has {t.shape[-1]} features, not {h.heads} heads x "
            f"{h.head_dim}; pass n_heads= or head_proj="
        )
    return t.view(*t.shape[:-1], h.heads, h.head_dim)


def per_site(
    layer: PatchedLayer, over: tuple[str, ...], t: torch.Tensor, op: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """``op(t, dim=...)`` over everything but the sweep axes of ``t`` (batch first, heads split):
    ``torch.sum`` gives attribution scores, ``torch.any`` the sites where two runs differ."""
    keep = []
    if "position" in over:
        keep.append(1)
    if "head" in over:
        keep.append(t.ndim - 2)
    dims = [d for d in range(t.ndim) if d not in keep]
    if not dims:
        return t
    if op is torch.any:  # torch.any takes one dim at a time on older torch
        for d in sorted(dims, reverse=True):
            t = t.any(dim=d)
        return t
    return op(t, dim=dims)


def first_positions(
    layer: PatchedLayer,
    over: tuple[str, ...],
    sizes: tuple[int, ...],
    differ: torch.Tensor,
    todo: list[int],
) -> list[int]:
    """The first position (dim 1) at which each layer in ``todo`` changes the activation:
    ``differ`` is where the clean and corrupted (head-split) activations differ. A position layer
    is its position; a head, or the whole activation, its first position that differs (patching
    the equal positions before it changes nothing)."""
    if "position" in over:
        per = math.prod(sizes[1:])
        return [i // per for i in todo]
    t = differ
    for d in sorted(range(t.ndim), reverse=True):  # keep dim 1 and, for heads, dim -2
        if d != 1 and not (over == ("head",) and d == differ.ndim - 2):
            t = t.any(dim=d)
    t = t.view(t.shape[0], -1).to(torch.uint8)  # (positions, heads or 1)
    firsts = t.argmax(dim=0).tolist()  # the first True (every layer in todo has one)
    return [firsts[i] if over else firsts[0] for i in todo]


def site_masks(
    layer: PatchedLayer, over: tuple[str, ...], sizes: tuple[int, ...], chunk: range, ndim: int
) -> torch.Tensor | None:
    """Boolean masks ``(k, 1, ...)`` over the (head-split) activation of ``ndim`` dimensions
    (batch first) for the sites in ``chunk``; ``None`` for the whole activation."""
    if not over:
        return None
    k = len(chunk)
    idx = torch.tensor(list(chunk))
    flat = torch.zeros(k, *sizes, dtype=torch.bool)
    flat.view(k, -1)[torch.arange(k), idx] = True
    # lay the axes where they are in the activation: position is dim 1, head dim -2
    shape = [k, 1] + [1] * (ndim - 1)
    if over == ("position",):
        shape[2] = sizes[0]
    elif over == ("head",):
        shape[-2] = sizes[0]
    else:
        shape[2], shape[-2] = sizes
    return flat.view(shape)


def patched(
    layer: PatchedLayer, mask: torch.Tensor | None, clean: torch.Tensor, x: torch.Tensor, k: int
) -> torch.Tensor:
    """``x`` (``k * B`` rows of the corrupted activation) with each copy's sites taken from
    ``clean`` (``B`` rows)."""
    b = clean.shape[0]
    if x.shape[0] != k * b or x.shape[1:] != clean.shape[1:]:
        raise PatchingError(
            f"the activation of {layer.point!r} is {tuple(x.shape[1:])} per row in the corrupted "
            f"run and {tuple(clean.shape[1:])} in the clean run: the runs do not align"
        )
    cv = view(layer, clean).unsqueeze(0)
    if mask is None:
        out = cv.expand(k, *cv.shape[1:])
    else:
        xv = view(layer, x).view(k, b, *cv.shape[2:])
        out = torch.where(mask.to(x.device), cv, xv)
    return out.reshape(x.shape)


def _stack_hint(names: list[str]) -> str:
    """How to select one stack where the layers ``names`` (one per shape) sit in different
    submodules of the model (an encoder's and a decoder's blocks): ``hs.blocks(model,
    within=...)`` naming each; else a plain hint."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    stacks = list(dict.fromkeys(".".join(p[: common + 1]) for p in parts))  # the model's order
    named = not any(p[common].isdigit() for p in parts)  # not two blocks of one list
    if named and len(stacks) == len(names) and all(len(p) > common + 1 for p in parts):
        shown = " or ".join(f"hs.blocks(model, within={s!r})" for s in stacks)
        return f"select one stack at a time: {shown}"
    return "the layers see activations of different shapes"


def stack_layers(results: list[torch.Tensor], layers: list[PatchedLayer]) -> torch.Tensor:
    """The per-layer sweeps stacked ``[layers, *sites]``; an error naming a layer of each shape
    where they differ (e.g. an encoder's and a decoder's blocks: different lengths), and the
    stacks to select one at a time."""
    first: dict[tuple[int, ...], str] = {}
    for r, layer in zip(results, layers):
        first.setdefault(tuple(r.shape), layer.name)
    if len(first) > 1:
        shown = ", ".join(f"{s} from {n!r}" for s, n in sorted(first.items()))
        raise PatchingError(
            f"the layers give sweeps of different shapes {sorted(first)}; sweep them separately: "
            f"{shown} ({_stack_hint(list(first.values()))})"
        )
    return torch.stack(results)
