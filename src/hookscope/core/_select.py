"""Layer selection: turn names, globs, module types and predicates into ``{name: module}``.

Every hookscope feature that takes ``layers`` resolves them here, so the rules (and the helpful
errors) are the same everywhere.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch
import torch.nn as nn

from ._compiled import clean_name, is_optimized, named_modules, strip_compiled
from ._errors import HookscopeWarning, LayerNotFoundError

__all__ = ["Selector", "aliases", "find", "resolve", "suggest"]

Selector = Union[str, type, nn.Module, Callable[[str, nn.Module], bool]]  # noqa: UP007 (a runtime alias)
"""A layer selector: an exact dotted name (``""`` is the root), a glob (``"layer*.conv2"``), a
module class (``nn.ReLU``), a module instance, or a predicate ``(name, module) -> bool``."""

_GLOB_CHARS = frozenset("*?[")


def _is_leaf(module: nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def _behind_wrappers(name: str, names: list[str]) -> list[str]:
    """Names holding ``name``'s parts in order with more parts between or before them, ending
    in its last part: ``fc`` behind a wrapper is ``module.fc`` (DistributedDataParallel,
    DataParallel), ``layers.0.attn`` is ``layers.0._checkpoint_wrapped_module.attn``; the
    shortest first."""
    want = name.split(".")
    hits = []
    for x in names:
        parts = x.split(".")
        if len(parts) > len(want) and parts[-1] == want[-1]:
            rest = iter(parts)
            if all(p in rest for p in want):  # a subsequence, in order
                hits.append((len(parts), x))
    return [x for _, x in sorted(hits, key=lambda h: h[0])]


def suggest(name: str, names: Iterable[str], n: int = 5) -> list[str]:
    """The valid names closest to ``name`` (the name behind a wrapper's prefix, edit distance,
    then shared prefix, then siblings)."""
    names = [x for x in names if x != ""]
    close = _behind_wrappers(name, names)[:n]
    close += [x for x in difflib.get_close_matches(name, names, n=n, cutoff=0.6) if x not in close]
    if len(close) < n:
        # Names sharing the longest dotted prefix (siblings of a mistyped child).
        parts = name.split(".")
        for k in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:k])
            sib = [x for x in names if (x.startswith(prefix + ".") if prefix else "." not in x)]
            if sib:
                close += [
                    x
                    for x in difflib.get_close_matches(name, sib, n=n, cutoff=0.0)
                    if x not in close
                ]
                break
    return close[:n]


def aliases(model: nn.Module) -> dict[str, str]:
    """``{second name: first name}`` of every module registered under several names (a module
    assigned twice, a list holding one block three times), their submodules' names included.
    ``named_modules`` lists such a module once, under its first name, which every selection
    uses: its hooks see the calls made through every name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    try:
        for name, module in model.named_modules(remove_duplicate=False):
            if is_optimized(module):
                continue  # its _orig_mod comes next, under the same clean name
            name = clean_name(name)
            known = first.setdefault(id(module), name)
            if known != name:
                out[name] = known
    except RecursionError:  # a module holding itself: no second names read
        return {}
    return out


def _shared_note(model_name: str, seconds: dict[str, str]) -> str:
    by_first: dict[str, list[str]] = {}
    for second, first in seconds.items():
        by_first.setdefault(first, []).append(second)
    return "; ".join(
        f"{', '.join(map(repr, names))} {'is' if len(names) == 1 else 'are'} the module named "
        f"{first!r} in {model_name}"
        for first, names in by_first.items()
    )


def _not_found(what: str, names: list[str], query: str | None) -> LayerNotFoundError:
    hint = suggest(query, names) if query is not None else []
    if hint:
        tail = "closest valid names: " + ", ".join(repr(h) for h in hint)
    else:
        sample = [x for x in names if x][:8]
        tail = (
            "some valid names: "
            + ", ".join(repr(h) for h in sample)
            + (" ..." if len(names) > 9 else "")
        )
    return LayerNotFoundError(f"{what}; {tail}")


def _match(
    model: nn.Module, model_name: str, all_modules: dict[str, nn.Module], sel: Any
) -> dict[str, nn.Module]:
    if isinstance(sel, str):
        if sel in all_modules:
            return {sel: all_modules[sel]}
        if _GLOB_CHARS & set(sel):
            hit = {k: m for k, m in all_modules.items() if k and fnmatch.fnmatchcase(k, sel)}
            seconds = {
                k: v
                for k, v in aliases(model).items()
                if fnmatch.fnmatchcase(k, sel) and v in all_modules
            }
            if seconds:  # they were dropped without a word: named_modules lists them once
                warnings.warn(
                    f"pattern {sel!r}: {_shared_note(model_name, seconds)} (one module registered "
                    "under several names): selected once, under that first name; its hooks see "
                    "its calls through every name",
                    HookscopeWarning,
                    stacklevel=4,
                )
                hit.update({v: all_modules[v] for v in seconds.values()})
            if not hit:
                raise _not_found(
                    f"pattern {sel!r} matched no layer of {model_name}",
                    list(all_modules),
                    sel.replace("*", "").replace("?", ""),
                )
            return hit
        first = aliases(model).get(clean_name(sel))
        if first is not None and first in all_modules:
            raise LayerNotFoundError(
                f"no layer named {sel!r} in {model_name}: {_shared_note(model_name, {sel: first})} "
                f"(one module registered under several names, listed under its first); select "
                f"{first!r}: its hooks see its calls through every name"
            )
        if clean_name(sel) in all_modules and clean_name(sel) != sel:
            raise LayerNotFoundError(
                f"no layer named {sel!r} in {model_name}: hookscope names the layers of a compiled "
                f"model as in the uncompiled model, without '_orig_mod'; use {clean_name(sel)!r}"
            )
        raise _not_found(f"no layer named {sel!r} in {model_name}", list(all_modules), sel)
    if isinstance(sel, type) and issubclass(sel, nn.Module):
        hit = {k: m for k, m in all_modules.items() if isinstance(m, sel)}
        if not hit:
            present = sorted({type(m).__name__ for m in all_modules.values()})
            raise LayerNotFoundError(
                f"no layer of type {sel.__name__} in {model_name}; types present: {', '.join(present[:15])}"
            )
        return hit
    if isinstance(sel, nn.Module):
        for k, m in all_modules.items():
            if m is sel:
                return {k: m}
        raise LayerNotFoundError(
            f"the {type(sel).__name__} instance given is not a submodule of {model_name}"
        )
    if isinstance(sel, type):  # a class, not a module's: calling it would not select
        raise TypeError(
            f"a layer selector class must be an nn.Module subclass (nn.Linear, a block's class); "
            f"got {sel.__name__}, which is not one: select by name, glob, module class, module, "
            "or a predicate (name, module) -> bool"
        )
    if callable(sel):
        _check_predicate(sel)
        hit = {k: m for k, m in all_modules.items() if sel(k, m)}
        if not hit:
            raise LayerNotFoundError(
                f"predicate {getattr(sel, '__name__', sel)!r} matched no layer of {model_name}"
            )
        return hit
    raise TypeError(
        f"a layer selector must be a name, glob, module class, module or predicate (name, module) -> bool; "
        f"got {type(sel).__name__}: {sel!r}"
    )


def _check_predicate(sel: Any) -> None:
    """A predicate selector takes ``(name, module)``: one that cannot be called so is refused
    by name before it is called (a ``lambda m: ...`` of one argument raised Python's own
    ``TypeError``, naming no selector)."""
    try:
        sig = inspect.signature(sel)
    except (TypeError, ValueError):  # a builtin or C callable: its signature is not known
        return
    try:
        sig.bind("name", None)
    except TypeError:
        raise TypeError(
            f"a predicate layer selector is called as predicate(name, module) -> bool; "
            f"{getattr(sel, '__name__', type(sel).__name__)}{sig} cannot take those two "
            "arguments (for a test on the module alone: lambda name, m: isinstance(m, nn.Linear))"
        ) from None


def find(model: nn.Module, *selectors: Selector, leaves: bool = False) -> dict[str, nn.Module]:
    """Select layers of ``model`` and return ``{dotted_name: module}`` in the model's order.

    Each selector is an exact dotted name (``""`` is the model itself), a glob (``*`` also matches
    dots), a module class, a module instance or a predicate ``(name, module) -> bool``. With no
    selector every module is returned. ``leaves=True`` keeps only modules without children. Every
    selector must match at least one layer, so typos fail loudly.

    Raises:
        LayerNotFoundError: a selector matched nothing; the message lists the closest valid names.

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> list(hs.find(net, nn.Linear))
        ['0', '2']
        >>> list(hs.find(net, leaves=True))
        ['0', '1', '2']
    """
    all_modules = dict(named_modules(model))  # a compiled model gets its uncompiled names
    model_name = type(strip_compiled(model)).__name__
    if not selectors:
        chosen = all_modules
    else:
        chosen_names: set[str] = set()
        for sel in selectors:
            chosen_names.update(_match(model, model_name, all_modules, sel))
        chosen = {k: m for k, m in all_modules.items() if k in chosen_names}
    if leaves:
        chosen = {k: m for k, m in chosen.items() if _is_leaf(m)}
    return chosen


_FORMS = (
    "a layer name, a glob, a module class, a module, a predicate (name, module) -> bool, "
    "or a list or {name: module} dict of these"
)


def resolve(model: nn.Module, layers: Any, what: str = "layers") -> dict[str, nn.Module]:
    """Resolve a ``layers`` argument: one selector, or an iterable/mapping of selectors.

    ``None`` selects every module. An empty list, tuple, set or dict selects nothing, which is
    always a mistake: it raises (as a selector that matches nothing does). ``what`` names the
    argument in the messages.

    Raises:
        LayerNotFoundError: the selection is empty or a selector matched nothing.
        TypeError: ``layers`` is not a selector form (e.g. an int).
    """
    if layers is None:
        return find(model)
    if isinstance(layers, Mapping):
        layers = list(layers.keys())
    elif isinstance(layers, (str, type, nn.Module)) or (
        callable(layers) and not isinstance(layers, Iterable)
    ):
        return find(model, layers)
    elif isinstance(layers, Iterable) and not isinstance(layers, (bytes, torch.Tensor)):
        layers = list(layers)
    else:
        raise TypeError(f"{what} must be {_FORMS}; got {type(layers).__name__}: {layers!r}")
    if not layers:
        raise LayerNotFoundError(
            f"{what} is empty: it selects no layer; name at least one ({_FORMS}), "
            "or pass None for every module"
        )
    return find(model, *layers)
