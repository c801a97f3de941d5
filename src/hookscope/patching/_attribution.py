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

from ..core._scope import HookScope, internal_run
from ._inputs import PatchingError, check_common, check_count
from ._job import PatchMetric, SweepJob, check_calls, prepare, score
from ._layer_sweep import LayerSweep
from ._sites import (
    PatchedLayer,
    grid,
    per_site,
    resolve_layers,
    set_act,
    stack_layers,
    view,
)

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

    Refused as :func:`patch_sweep` refuses (a model whose clean run draws random numbers, batch
    norm in training mode, meta weights, heads where the module declares none), and under
    ``torch.inference_mode()`` (no gradients there; ``torch.no_grad()`` is fine: gradients are
    turned on inside).

    Args:
        model: any ``nn.Module``.
        clean: token ids, or a dict of keyword inputs.
        corrupt: as ``clean``, aligned token by token.
        metric: ``metric(output) -> scalar tensor`` computed from the output (autograd).
        layers: the layers to score (rows in the order of a list, as in :func:`patch_sweep`).
        at: ``"output"`` or ``"input"`` of each layer.
        over: the sweep axes, as in :func:`patch_sweep`.
        arg: with ``at="input"`` only, the input to score (an index >= 0 or a keyword name).
        reverse: the gradient at the clean run, the difference reversed.
        n_heads: the head count of a module that declares none.
        head_proj: the output projection under the attention module.
        top_k: also patch the ``top_k`` sites of largest ``|score|`` exactly.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> clean, corrupt = torch.ones(1, 3, 2), torch.zeros(1, 3, 2)
        >>> s = hs.attribution_patch(net, clean, corrupt, lambda y: y.sum(), ["0"])
        >>> e = hs.patch_sweep(net, clean, corrupt, lambda y: y.sum(), ["0"]) - net(corrupt).sum()
        >>> torch.allclose(s, e, atol=1e-5)  # a linear model: the estimate is exact
        True
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        if torch.is_inference_mode_enabled():
            raise PatchingError(
                "attribution_patch needs autograd, but it was called under torch.inference_mode(); "
                "call it outside that block (it turns gradients on itself: torch.no_grad() around it "
                "is fine)"
            )
        check_common("attribution_patch", metric, at, arg, reverse, head_proj)
        check_count(top_k, "top_k", "the sites to patch exactly")
        src, dst = prepare(model, clean, corrupt, reverse)
        chosen, over_t, names = resolve_layers(
            model, layers, at=at, over=over, arg=arg, n_heads=n_heads, head_proj=head_proj
        )
        job = SweepJob.create(
            model, dst, metric, over_t, what="attribution_patch", block_names=names
        )
        with torch.no_grad():
            clean_acts, _, job.per_row = job.record(src, chosen, what="attribution_patch")
        deltas, grads, value = _gradients(job, chosen, clean_acts)
        scores = []
        for layer in chosen:
            g = grads.get(layer.point)
            delta = deltas[layer.point]
            if g is None:
                g = torch.zeros_like(delta)
            acc = torch.float64 if delta.dtype == torch.float64 else torch.float32
            prod = view(layer, delta.to(acc) * g.to(acc))
            scores.append(per_site(layer, over_t, prod, torch.sum))
        out = stack_layers(scores, chosen).detach()
        if top_k is None:
            return out
        return out, _exact_top(job, chosen, clean_acts, out, top_k, value)


def _gradients(
    job: SweepJob, chosen: list[PatchedLayer], clean_acts: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """One corrupted forward and one backward: each layer's ``clean - corrupt`` activation, the
    metric's gradient with respect to it (missing where the metric does not depend on it), and
    the metric. The difference is taken in the hook, from the activation as the call got or made
    it: the model may change that tensor in place later (``h += block(norm(h))`` after a
    norm's input), which a reference to it would see."""
    deltas: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    zeros: list[torch.Tensor] = []
    with torch.enable_grad(), HookScope("attribution_patch") as scope:
        for layer in {s.point: s for s in chosen}.values():

            def track(x: torch.Tensor, s: PatchedLayer = layer) -> torch.Tensor:
                calls[s.point] = calls.get(s.point, 0) + 1
                clean = clean_acts[s.point]
                if clean.shape != x.shape:
                    raise PatchingError(
                        f"the activation of {s.point!r} is {tuple(clean.shape)} in the clean run "
                        f"and {tuple(x.shape)} in the corrupted run: they do not align"
                    )
                deltas[s.point] = clean - x.detach()
                z = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
                zeros.append(z)
                a = x + z  # the same values; a tensor whose gradient is this layer's own

                def keep(g: torch.Tensor, p: str = s.point) -> None:
                    grads[p] = g

                scope.add_activation_grad_hook(a, keep, layer=s.point)
                return a

            if layer.kind == "input":

                def pre(m: nn.Module, a: Any, k: Any, s: PatchedLayer = layer, f=track) -> Any:
                    return set_act(s, m, a, k, None, f)

                module = job.modules[layer.point]
                scope.add_forward_pre(module, pre, layer=layer.point, with_kwargs=True)
            else:

                def post(m: nn.Module, a: Any, o: Any, s: PatchedLayer = layer, f=track) -> Any:
                    return set_act(s, m, a, {}, o, f)

                scope.add_forward(job.modules[layer.point], post, layer=layer.point)
        value = job.metric(job.model(**job.dst))
        for layer in chosen:
            check_calls(layer, calls.get(layer.point, 0))
        score(value, chosen[0].name)  # raises for anything but a scalar
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            raise PatchingError(
                "the metric does not depend on the patched layers through autograd (it returned "
                f"{'a tensor' if isinstance(value, torch.Tensor) else type(value).__name__} "
                "without a gradient); return a tensor computed from the output"
            )
        torch.autograd.grad(value, zeros, allow_unused=True)
    return deltas, grads, value


def _exact_top(
    job: SweepJob,
    chosen: list[PatchedLayer],
    clean_acts: dict[str, torch.Tensor],
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
        for li, layer in enumerate(chosen):
            sites = sorted(
                i - li * per_layer for i in top if li * per_layer <= i < (li + 1) * per_layer
            )
            if not sites:
                continue
            act = clean_acts[layer.point]
            sizes = grid(layer, job.over, act.shape)
            assert math.prod(sizes) == per_layer
            vals = LayerSweep(job, layer, act, sizes).values(sites)
            for i, v in zip(sites, vals):
                exact.view(len(chosen), -1)[li, i] = float(v) - base_value
    return exact
