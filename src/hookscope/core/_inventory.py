"""List every hook on a model (hookscope's and everyone else's) and remove only hookscope's.

PyTorch has no public "list/remove all hooks" (pytorch#2847), and DDP, FSDP, checkpointing and
other libraries add their own, so a blanket clear would break them. hookscope reads PyTorch's hook
dicts and tells its own hooks apart by their type.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.nn.modules import module as _module_mod

from ._compiled import clean_name
from ._scope import _Hook, _InertHook, note_stripped

__all__ = ["HookInfo", "has_global_hooks", "hooks_on", "module_hooks", "remove_hooks"]

# (attribute on the module, kind reported)
_MODULE_DICTS = (
    ("_forward_pre_hooks", "forward_pre"),
    ("_forward_hooks", "forward"),
    ("_backward_pre_hooks", "backward_pre"),
    ("_backward_hooks", "backward"),
)
# Side tables keyed by hook id that must be cleaned together with the main dict.
_SIDE_TABLES = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
}
_TENSOR_DICTS = (
    ("_backward_hooks", "tensor"),
    ("_post_accumulate_grad_hooks", "post_accumulate_grad"),
)
_GLOBAL_DICTS = (
    ("_global_forward_pre_hooks", "global_forward_pre"),
    ("_global_forward_hooks", "global_forward"),
    ("_global_backward_pre_hooks", "global_backward_pre"),
    ("_global_backward_hooks", "global_backward"),
)


@dataclass(frozen=True)
class HookInfo:
    """One hook found on a model.

    Attributes:
        kind: ``forward_pre``, ``forward``, ``backward`` (full, or ``legacy_backward``),
            ``backward_pre``, ``tensor`` (a parameter's gradient hook), ``post_accumulate_grad``,
            or ``global_*`` for hooks registered for every module.
        layer: dotted module name (a parameter's name for parameter hooks, ``*`` for global hooks).
        owner: ``"hookscope"`` for hooks hookscope added (``feature`` says which), else ``"other"``.
        feature: the hookscope feature that owns it (``capture``, ``edit``, ...), or the hook's
            ``module.qualname`` for other hooks.
        hook: the registered callable.
    """

    kind: str
    layer: str
    owner: str
    feature: str
    hook: Any = None

    def __repr__(self) -> str:
        return f"HookInfo({self.kind}, layer={self.layer!r}, owner={self.owner}, feature={self.feature!r})"


def _describe(fn: Any) -> tuple[str, str]:
    if isinstance(fn, (_Hook, _InertHook)):
        return "hookscope", fn.owner + (" (inert copy)" if isinstance(fn, _InertHook) else "")
    target = getattr(fn, "__func__", fn)
    mod = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or type(target).__qualname__
    return "other", f"{mod}.{qual}"


def _iter(model: nn.Module) -> Iterator[tuple[Any, str, str, Any, int]]:
    """Yield (container, attr, kind, layer, hook_id) for every hook on the model."""
    for raw, mod in model.named_modules():
        name = clean_name(raw)
        for attr, kind in _MODULE_DICTS:
            d = getattr(mod, attr, None)
            if not d:
                continue
            if attr == "_backward_hooks" and getattr(mod, "_is_full_backward_hook", None) is False:
                kind = "legacy_backward"
            for hid in list(d):
                yield mod, attr, kind, name, hid
    for pname, p in model.named_parameters():
        for attr, kind in _TENSOR_DICTS:
            d = getattr(p, attr, None)
            if not d:
                continue
            for hid in list(d):
                yield p, attr, kind, clean_name(pname), hid


def hooks_on(model: nn.Module, *, include_global: bool = True) -> list[HookInfo]:
    """Every hook on ``model``: its modules' hooks, its parameters' hooks and global module hooks.

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> net = nn.Linear(2, 2)
        >>> h = net.register_forward_hook(lambda m, i, o: None)
        >>> [(x.kind, x.owner) for x in hs.hooks_on(net)]
        [('forward', 'other')]
        >>> h.remove()
    """
    found = []
    for container, attr, kind, layer, hid in _iter(model):
        fn = getattr(container, attr)[hid]
        owner, feature = _describe(fn)
        found.append(HookInfo(kind, layer, owner, feature, fn))
    if include_global:
        for attr, kind in _GLOBAL_DICTS:
            for fn in getattr(_module_mod, attr, {}).values():
                owner, feature = _describe(fn)
                found.append(HookInfo(kind, "*", owner, feature, fn))
    return found


def has_global_hooks() -> bool:
    """Whether any global module hook (``register_module_forward_hook`` and the like) is set."""
    return any(getattr(_module_mod, attr, None) for attr, _ in _GLOBAL_DICTS)


def module_hooks(module: nn.Module) -> Iterator[Any]:
    """The forward, forward-pre, backward and backward-pre hooks registered on ``module`` itself."""
    for attr, _ in _MODULE_DICTS:
        yield from (getattr(module, attr, None) or {}).values()


def remove_hooks(model: nn.Module) -> int:
    """Remove every hook hookscope added to ``model`` (and inert copies); return how many.

    Hooks from PyTorch, DDP, FSDP, checkpointing or the user are left in place. A scope still
    open whose hooks this takes remembers it: a later read of a ``capture`` (or the warning of an
    ``edit`` at its exit) says its hooks were removed here, not that the layer never ran.

    Example:
        >>> import torch.nn as nn
        >>> import hookscope as hs
        >>> net = nn.Linear(2, 2)
        >>> mine = net.register_forward_hook(lambda m, i, o: None)
        >>> cap = hs.capture(net, "")   # a scope never closed
        >>> remove_hooks(net), len(hs.hooks_on(net))
        (1, 1)
        >>> mine.remove()
    """
    removed = 0
    stripped: dict[int, set[str]] = {}  # {scope id: layers} of the hooks of open scopes
    for container, attr, _kind, _layer, hid in _iter(model):
        d = getattr(container, attr)
        fn = d.get(hid)
        if isinstance(fn, (_Hook, _InertHook)):
            del d[hid]
            scope_id = getattr(fn, "scope_id", None)
            if scope_id is not None:
                stripped.setdefault(scope_id, set()).add(fn.layer)
            release = getattr(fn, "release", None)  # a hook inside a compiled region
            if release is not None:
                release()
            for side in _SIDE_TABLES.get(attr, ()):
                table = getattr(container, side, None)
                if table is not None and hid in table:
                    if isinstance(table, dict):
                        del table[hid]
                    else:
                        table.discard(hid)
            removed += 1
    note_stripped(stripped)
    return removed
