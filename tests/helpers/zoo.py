"""Helpers for the model-zoo sweep (tests/suites/test_zoo.py): build a model cheaply, pick layers."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

import torch
import torch.nn as nn

NORM = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
_FX_SUFFIX = re.compile(r"_\d+$")  # FX reads `ln_1` as the 2nd call of `ln` (see test_zoo.py)


@contextlib.contextmanager
def cheap_init():
    """Random weights without the cost of each model's own initialisation scheme (kaiming,
    trunc_normal, orthogonal ... on hundreds of millions of parameters): every init function
    becomes one ``normal_(0, 0.02)``-like fill; values differ, the comparison does not care."""
    import torch.nn.init as init

    names = [
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "xavier_normal_",
        "xavier_uniform_",
        "orthogonal_",
        "constant_",
        "zeros_",
        "ones_",
    ]
    saved = {n: getattr(init, n) for n in names}

    def fill(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        with torch.no_grad():
            return t.uniform_(-0.05, 0.05) if t.ndim > 1 else t.uniform_(0.5, 1.0)

    try:
        for n in names:
            setattr(init, n, fill)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def leaves_in_call_order(
    model: nn.Module, x: torch.Tensor
) -> tuple[list[str], set[str], set[str], dict[str, torch.Tensor]]:
    """One forward with plain hooks on every leaf. Returns the leaves in the order of their first
    call (tensor outputs only); those called more than once; those whose output the model changed
    in place *between* modules, i.e. by its own code (``out += identity``), not by an in-place
    layer; and each leaf's output as a plain hook copies it (``out.detach().clone()``)."""
    order: list[str] = []
    seen: dict[str, int] = {}
    copies: dict[str, torch.Tensor] = {}
    recent: list[tuple[str, torch.Tensor, int]] = []  # outputs not yet checked by a later pre-hook
    between: set[str] = set()

    def check(*_: Any) -> None:
        for name, t, v in recent:
            if t._version != v:
                between.add(name)
        recent.clear()

    handles = []
    for name, m in model.named_modules():
        if name and next(iter(m.children()), None) is None:

            def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
                seen[name] = seen.get(name, 0) + 1
                if seen[name] == 1 and isinstance(out, torch.Tensor):
                    order.append(name)
                    recent.append((name, out, out._version))
                    copies[name] = out.detach().clone()

            handles.append(m.register_forward_pre_hook(check))
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
        check()
    finally:
        for h in handles:
            h.remove()
    reused = {n for n, c in seen.items() if c > 1}
    return order, reused, between, copies


def pick_layers(
    model: nn.Module, x: torch.Tensor, fx_nodes: set[str] | None
) -> tuple[list[str], str, dict[str, torch.Tensor]]:
    """Three layers in call order: a residual site (a norm whose output the model's code changes in
    place later, ``out += identity``; else any layer changed so; else a norm), one in the middle,
    and the last leaf. Returns the layers, the residual site and the layers' outputs
    as a plain hook that copies records them."""
    order, reused, modified, copies = leaves_in_call_order(model, x)
    mods = dict(model.named_modules())
    ok = [n for n in order if n not in reused and (fx_nodes is None or n in fx_nodes)]
    tensor_out = [n for n in ok if not _FX_SUFFIX.search(n)] if fx_nodes is not None else ok
    norms = [n for n in tensor_out if isinstance(mods[n], NORM)]

    # a norm whose output the model's own code changed in place later: the residual site
    site = next((n for n in norms if n in modified), None)
    if site is None:
        site = next((n for n in tensor_out if n in modified), None)
    if site is None and norms:
        site = norms[len(norms) // 3]
    pool = [n for n in tensor_out if n != site]
    if site is None:
        site = pool[len(pool) // 3]
    after = [n for n in pool if order.index(n) > order.index(site)]
    last = after[-1]
    mid = after[len(after) // 2] if len(after) > 1 else pool[0]
    layers = sorted({site, mid, last}, key=order.index)
    return layers, site, {n: copies[n] for n in layers}


def unique_params(model: nn.Module) -> int:
    """Parameters counted once each, however many modules share them (by identity)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), p.numel())
    return sum(seen.values())


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0
