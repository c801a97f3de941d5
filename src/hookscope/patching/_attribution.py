"""``attribution_patch``: every site's patching effect, linearised, from 2 forwards + 1 backward.

Attribution patching (Nanda 2023; AtP, Kramar et al. 2024) replaces each patched run by a first
order estimate: ``metric(patched) - metric(corrupt) ~= (clean - corrupt) . d metric / d act``,
the gradient taken in the corrupted run and the product summed over the batch and over each
site's features. One clean forward records the activations, one corrupted forward and one
backward give every gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._compiled import named_modules
from ..core._scope import HookScope
from ._inputs import PatchingError
from ._sites import Site, grid, per_site, resolve_sites, set_act, view
from ._sweep import PatchMetric, _check_calls, _scalar, check_training, prepare, record, sweep_layer

__all__ = ["attribution_patch"]


def attribution_patch(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: PatchMetric,
    layers: Any,
    *,
    at: Literal["output", "input"] = "output",
    over: Sequence[str] = ("position",),
    arg: int | str | None = None,
    reverse: bool = False,
    n_heads: int | None = None,
    head_proj: str | None = None,
    top_k: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attribution patching: the estimated effect of every site of :func:`patch_sweep` (same
    arguments, same output shape) from one clean forward, one corrupted forward and one backward.

    ``score = (clean_act - corrupt_act) . d metric / d act`` (the gradient at the corrupted run),
    summed over the batch and the site's features (the hidden dimension, or a head's
    ``head_dim``). It estimates ``patch_sweep(...) - metric(corrupted run)``. No parameter's
    ``.grad`` is touched. With ``top_k`` the ``k`` sites of largest ``|score|`` are also patched
    exactly, and ``(scores, exact)`` is returned: ``exact`` holds ``metric(patched) -
    metric(corrupted run)`` at those sites and NaN elsewhere.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> clean, corrupt = torch.ones(1, 3, 2), torch.zeros(1, 3, 2)
        >>> s = hs.attribution_patch(net, clean, corrupt, lambda y: y.sum(), ["0"])
        >>> e = hs.patch_sweep(net, clean, corrupt, lambda y: y.sum(), ["0"]) - net(corrupt).sum()
        >>> torch.allclose(s, e, atol=1e-5)  # a linear model: the estimate is exact
        True
    """
    src, dst, batch = prepare(model, clean, corrupt, reverse)
    check_training(model, "attribution_patch")
    sites, over_t = resolve_sites(
        model, layers, at=at, over=over, arg=arg, n_heads=n_heads, head_proj=head_proj
    )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    with torch.no_grad():
        clean_acts, _, _ = record(model, src, sites, batch)
    modules = dict(named_modules(model))
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    zeros: list[torch.Tensor] = []
    with torch.enable_grad(), HookScope("attribution_patch") as scope:
        for site in {s.point: s for s in sites}.values():

            def track(x: torch.Tensor, s: Site = site) -> torch.Tensor:
                calls[s.point] = calls.get(s.point, 0) + 1
                acts[s.point] = x.detach()
                z = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
                zeros.append(z)
                a = x + z  # the same values; a tensor whose gradient is this site's own

                def keep(g: torch.Tensor, p: str = s.point) -> None:
                    grads[p] = g

                scope.add_activation_grad_hook(a, keep, layer=s.point)
                return a

            if site.kind == "input":

                def pre(m: nn.Module, a: Any, k: Any, s: Site = site, f=track) -> Any:
                    return set_act(s, m, a, k, None, f)

                scope.add_forward_pre(modules[site.point], pre, layer=site.point, with_kwargs=True)
            else:

                def post(m: nn.Module, a: Any, o: Any, s: Site = site, f=track) -> Any:
                    return set_act(s, m, a, {}, o, f)

                scope.add_forward(modules[site.point], post, layer=site.point)
        base = metric(model(**dst))
        for site in sites:
            _check_calls(site, calls.get(site.point, 0))
        value = torch.as_tensor(base)
        if value.ndim != 0:
            _scalar(value, sites[0].layer)  # raises with the message
        if not value.requires_grad:
            raise PatchingError(
                "the metric does not depend on the patched layers through autograd (it returned "
                "a tensor without a gradient); return a tensor computed from the output"
            )
        torch.autograd.grad(value, zeros, allow_unused=True)
    scores = []
    for site in sites:
        g = grads.get(site.point)
        delta = clean_acts[site.point] - acts[site.point]
        if g is None:
            g = torch.zeros_like(delta)
        prod = view(site, delta.to(torch.float32) * g.to(torch.float32))
        scores.append(per_site(site, over_t, prod, torch.sum))
    out = torch.stack(scores).detach()
    if top_k is None:
        return out
    return out, _exact_top(model, dst, sites, over_t, clean_acts, metric, batch, out, top_k, value)


def _exact_top(
    model: nn.Module,
    dst: dict[str, Any],
    sites: list[Site],
    over: tuple[str, ...],
    clean_acts: dict[str, torch.Tensor],
    metric: PatchMetric,
    batch: int,
    scores: torch.Tensor,
    top_k: int,
    base: torch.Tensor,
) -> torch.Tensor:
    """The exact effect of the ``top_k`` sites of largest ``|score|``, NaN elsewhere."""
    exact = torch.full_like(scores, float("nan"))
    per_layer = scores[0].numel()
    flat = scores.abs().flatten()
    top = flat.topk(min(top_k, flat.numel())).indices.tolist()
    base_value = float(base.detach())
    with torch.no_grad():
        for li, site in enumerate(sites):
            chosen = sorted(
                i - li * per_layer for i in top if li * per_layer <= i < (li + 1) * per_layer
            )
            if not chosen:
                continue
            sizes = grid(site, over, clean_acts[site.point].shape)
            assert math.prod(sizes) == per_layer
            act = clean_acts[site.point]
            vals = sweep_layer(model, dst, site, over, sizes, [chosen], act, metric, batch)
            for i, v in zip(chosen, vals):
                exact.view(len(sites), -1)[li, i] = float(v) - base_value
    return exact
