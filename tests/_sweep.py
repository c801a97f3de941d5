"""Helpers for the model-zoo sweep (tests/test_zoo.py): build a model cheaply, pick layers."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.nn as nn

NORM = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


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


def leaves_in_call_order(model: nn.Module, x: torch.Tensor) -> tuple[list[str], set[str], set[str]]:
    """Leaf modules in the order their (first) call ran (tensor outputs only); those called more than once; those whose
    output the model changed in place after the call (recorded by plain hooks, versions)."""
    order: list[str] = []
    seen: dict[str, int] = {}
    outs: dict[str, tuple[torch.Tensor, int]] = {}
    handles = []
    for name, m in model.named_modules():
        if name and next(iter(m.children()), None) is None:

            def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
                seen[name] = seen.get(name, 0) + 1
                if seen[name] == 1 and isinstance(out, torch.Tensor):
                    order.append(name)
                    outs[name] = (out, out._version)

            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    reused = {n for n, c in seen.items() if c > 1}
    modified = {n for n, (t, v) in outs.items() if t._version != v}
    return order, reused, modified


def pick_layers(
    model: nn.Module, x: torch.Tensor, fx_nodes: set[str] | None
) -> tuple[list[str], str | None]:
    """Three layers in call order: a residual site (a norm whose output the model changes in place
    later, e.g. ``out += identity``; else a norm feeding an add in the FX graph; else a norm), one
    in the middle, and the last leaf. Returns the layers and the residual site (if any)."""
    order, reused, modified = leaves_in_call_order(model, x)
    mods = dict(model.named_modules())
    ok = [n for n in order if n not in reused and (fx_nodes is None or n in fx_nodes)]
    tensor_out = ok
    norms = [n for n in tensor_out if isinstance(mods[n], NORM)]

    # a norm changed in place later that is the last norm of its block: the residual site
    # (`out += identity` after bn2/bn3), rather than a norm changed by its in-place activation
    def last_norm_of_block(n: str) -> bool:
        parent = mods[n.rsplit(".", 1)[0]] if "." in n else model
        kids = [k for k, m in parent.named_children() if isinstance(m, NORM)]
        return bool(kids) and n.rsplit(".", 1)[-1] == kids[-1]

    site = next((n for n in norms if n in modified and last_norm_of_block(n)), None)
    if site is None:
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
    return layers, site


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
