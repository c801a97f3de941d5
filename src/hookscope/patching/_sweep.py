"""``patch_sweep``: activation patching over layers x sites, in batched passes that are checked."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._errors import HookscopeWarning
from ..core._scope import internal_run
from ._cached_prefix import CausalPrefix, drop_cache, wants_cache
from ._inputs import PatchingError, check_common, check_count
from ._job import PatchMetric, SweepJob, prepare
from ._layer_sweep import LayerSweep
from ._sites import (
    PatchedLayer,
    grid,
    per_site,
    resolve_layers,
    stack_layers,
    view,
)

__all__ = ["PatchMetric", "patch_sweep"]


def patch_sweep(
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
    rows: int | None = None,
    max_bytes: int | None = None,
) -> torch.Tensor:
    """Patch each layer's clean activation into the corrupted run, site by site; the metric of
    every patched run as a tensor shaped ``[layers, *over]``.

    A site is one position (``over=("position",)``), one attention head (``("head",)``), one
    head at one position (``("position", "head")``) or the whole activation (``()``) of a
    selected layer. The activation is the layer's output (its first tensor: HF attention returns
    a tuple), or with ``at="input"`` its first tensor input, positional or ``hidden_states``. A
    head's activation is its slice of the input of the attention module's output projection,
    split by the query-head count that the module declares (a ``num_heads``/``head_dim``-like
    attribute on it or a submodule); a module that declares no heads (an MLP) is refused.

    Sites go into the rows of few passes: the layers before the patched one run once on the
    batch, the rows fan out from the patched layer's block on (its sites in one pass, chunked
    to ``max_bytes`` or ``rows``). A site whose clean activation equals the corrupted one exactly
    (in a causal model, every position before the first token that differs) is not run: its
    value is the corrupted run's metric. Every value returned is checked or exact by
    construction: the first pass of several sites of each layer is compared with its first and
    its last site patched alone (the metric, and every output tensor of their rows); where it
    differs, the layer runs with the model's inputs tiled (checked the
    same way), and where that differs too (a model that mixes the rows of a batch, e.g. by a
    batch statistic), one site per pass, with a warning naming the layer. A pass that runs out
    of memory is halved, with a warning; passes stay at most that size for the rest of the sweep.

    In a causal Hugging Face model (its forward takes ``past_key_values``, its attention says
    ``is_causal``, and ``use_cache=True`` gives a ``DynamicCache``), a patch at positions
    ``>= p0`` cannot change any earlier position of any layer, so a pass runs only positions
    ``p0..T-1``: the corrupted run's keys and values of the earlier ones come from its cache,
    and the output the metric gets is rebuilt to full length from the corrupted run's. Sites are
    grouped into passes by their first changed position (a position; for a head or the whole
    activation, its first position that differs). Each layer's first such pass is checked
    against a full run of one site (every output tensor); where it differs, that layer runs at
    full length with a warning. Encoders (BERT), encoder-decoder models, models without a cache,
    compiled models (each new length would recompile), outputs holding a tensor without a
    position axis (a classifier pooled at each row's last token) and inputs other than ``input_ids``/
    ``inputs_embeds``/``token_type_ids``/``position_ids``/a 2-D ``attention_mask`` run at full
    length. One difference from a full run, by design: the output at a padding position before
    ``p0`` that precedes a row's first real token (left padding) is the corrupted run's, where a
    full run lets that position attend to every position; a metric should read real tokens.

    Refused, with :class:`PatchingError`: a model whose first (clean) run draws random numbers
    (dropout in training mode, as a module or as a function inside attention: asked of the run,
    not of module types), or whose clean run, run twice, differs (a generator of its own); a
    model in training mode that draws nothing is swept as it is. Each argument of a wrong type
    or range, before any forward (``arg=`` without ``at="input"``, ``arg=1.0``, ``rows=2.5``). Batch
    norm in training mode (it would mix the rows of different sites); weights on the meta
    device. Forwards of the same model in other threads during a sweep run unpatched.

    Args:
        model: any ``nn.Module`` (a Hugging Face model, a compiled one).
        clean: token ids, or a dict of keyword inputs (with their ``attention_mask``).
        corrupt: as ``clean``; the two must align token by token (:class:`PatchingError` names
            the positions where they do not).
        metric: ``metric(output) -> scalar``, given one site's output (as many rows as the
            batch; a tensor, or a ``ModelOutput``: use ``.logits``).
        layers: the layers to patch (names, a glob, ``hs.blocks(model)``, ...); the rows follow
            a list in its order (a glob's layers in the model's order at its place), and a
            layer selected twice is refused.
        at: ``"output"`` or ``"input"`` of each layer.
        over: the sweep axes: ``("position",)``, ``("head",)``, ``("position", "head")``, ``()``.
        arg: with ``at="input"`` only, the input to patch (a positional index >= 0 or a keyword
            name).
        reverse: patch corrupted activations into the clean run instead.
        n_heads: the head count of a module that declares none (must equal a declared count).
        head_proj: the output projection under the attention module, where it is not one of
            ``c_proj``/``o_proj``/``dense``/``out_proj``.
        rows: rows per pass (``rows=`` the batch size: one site per pass).
        max_bytes: the memory a pass may use (default: half the free memory of a CUDA device;
            on the CPU a quarter of the available memory, at most 2 GiB).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> clean, corrupt = torch.ones(1, 3, 2), torch.zeros(1, 3, 2)
        >>> hs.patch_sweep(net, clean, corrupt, lambda y: y[:, -1].sum(), ["0", "1"]).shape
        torch.Size([2, 3])
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        check_common("patch_sweep", metric, at, arg, reverse, head_proj)
        check_count(rows, "rows", "rows per pass")
        check_count(max_bytes, "max_bytes", "the bytes a pass may use")
        src, dst = prepare(model, clean, corrupt, reverse)
        chosen, over_t, names = resolve_layers(
            model, layers, at=at, over=over, arg=arg, n_heads=n_heads, head_proj=head_proj
        )
        job = SweepJob.create(
            model, dst, metric, over_t, rows=rows, max_bytes=max_bytes, block_names=names
        )
        with torch.no_grad():
            acts, _, job.per_row = job.record(src, chosen, what="patch_sweep")
            if max_bytes is not None and rows is None and job.per_row * job.batch > max_bytes:
                warnings.warn(
                    f"patch_sweep: max_bytes={max_bytes} is less than one site's pass over the whole "
                    f"sequence needs (about {job.per_row * job.batch} bytes for {job.batch} rows); "
                    "sites run one per pass, and a pass may go over max_bytes. Raise max_bytes or use "
                    "a smaller batch",
                    HookscopeWarning,
                    stacklevel=2,
                )
            cached = wants_cache(model, dst)
            base_acts, base_out, _ = job.record(
                {**dst, "use_cache": True} if cached else dst, chosen
            )
            prefix = CausalPrefix.from_run(dst, base_out) if cached else None
            baseline = job.score(drop_cache(base_out), chosen[0])
            del base_out
            results = [
                _layer_values(
                    job, layer, (acts[layer.point], base_acts[layer.point]), baseline, prefix
                )
                for layer in chosen
            ]
        return stack_layers(results, chosen)


def _layer_values(
    job: SweepJob,
    layer: PatchedLayer,
    runs: tuple[torch.Tensor, torch.Tensor],
    baseline: torch.Tensor,
    prefix: CausalPrefix | None,
) -> torch.Tensor:
    """One layer's sweep, shaped by its sites: ``runs`` is its clean and corrupted activation."""
    clean_act, base_act = runs
    if clean_act.shape != base_act.shape:
        raise PatchingError(
            f"the activation of {layer.point!r} is {tuple(clean_act.shape)} in the clean "
            f"run and {tuple(base_act.shape)} in the corrupted run: they do not align"
        )
    sizes = grid(layer, job.over, clean_act.shape)
    # a site whose clean values equal the corrupted ones changes nothing: its run is the
    # corrupted run (e.g. every position before the first differing token, causally)
    differ = view(layer, clean_act != base_act)
    todo = per_site(layer, job.over, differ, torch.any).flatten().nonzero().flatten().tolist()
    full = baseline.to(clean_act.device).repeat(math.prod(sizes))
    if todo:
        vals = LayerSweep(job, layer, clean_act, sizes, prefix).values(todo, differ)
        full[todo] = torch.stack(vals).to(full.device)
    return full.view(sizes)
