"""``patch_sweep``: activation patching over layers x sites, in batched passes that are checked."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._errors import HookscopeWarning
from ._cached_prefix import CausalPrefix, drop_cache, wants_cache
from ._inputs import PatchingError
from ._job import PatchMetric, SweepJob, prepare
from ._layer_sweep import LayerSweep
from ._sites import PatchedLayer, grid, per_site, resolve_layers, view

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
    head at one position (``("position", "head")``) or the whole activation (``()``). The
    activation is the layer's output (its first tensor: HF attention returns a tuple), or with
    ``at="input"`` its first tensor input, positional or ``hidden_states`` (``arg`` names
    another). A head's activation is its slice of the input of the attention module's output
    projection (``c_proj``, ``o_proj``, ``dense``, ``out_proj``; ``head_proj`` names another),
    split by the query-head count (from the module or the config; ``n_heads`` sets it).
    ``reverse=True`` patches corrupted activations into the clean run instead.

    ``clean`` and ``corrupt`` are token ids or dicts of keyword inputs (with their
    ``attention_mask``); they must align token by token (:class:`PatchingError` names the
    positions where they do not). ``metric(output) -> scalar`` gets one site's output, as many
    rows as the batch (a tensor, or a ``ModelOutput``: use ``.logits``).

    Sites go into the rows of few passes: the layers before the patched one run once on the
    batch, the rows fan out from the patched layer's block on (its sites in one pass, chunked
    to ``max_bytes``, default a share of the free memory, or to ``rows`` rows per pass). A site
    whose clean activation equals the corrupted one exactly (in a causal model, every position
    before the first token that differs) is not run: its value is the corrupted run's metric.
    The first chunk of each layer is checked against one site run alone; a model whose batch
    cannot fan out mid-way runs with its inputs tiled instead, with a warning.

    In a causal Hugging Face model (its forward takes ``past_key_values``, its attention says
    ``is_causal``, and ``use_cache=True`` gives a ``DynamicCache``), a patch at positions
    ``>= p0`` cannot change any earlier position of any layer, so a pass runs only positions
    ``p0..T-1``: the corrupted run's keys and values of the earlier ones come from its cache,
    and the output the metric gets is rebuilt to full length from the corrupted run's. Sites are
    grouped into passes by their first changed position (a position; for a head or the whole
    activation, its first position that differs). Each layer's first such pass is checked
    against a full run of one site (every output tensor); where it differs, that layer runs at
    full length with a warning. Encoders (BERT), models without a cache, compiled models
    (each new length would recompile) and inputs other than ``input_ids``/``inputs_embeds``/
    ``token_type_ids``/``position_ids``/a 2-D ``attention_mask`` run at full length. One difference from a full run, by design: the
    output at a padding position before ``p0`` that precedes a row's first real token (left
    padding) is the corrupted run's, where a full run lets that position attend to every
    position; a metric should read real tokens.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> clean, corrupt = torch.ones(1, 3, 2), torch.zeros(1, 3, 2)
        >>> hs.patch_sweep(net, clean, corrupt, lambda y: y[:, -1].sum(), ["0", "1"]).shape
        torch.Size([2, 3])
    """
    src, dst, _ = prepare(model, clean, corrupt, reverse, "patch_sweep")
    chosen, over_t = resolve_layers(
        model, layers, at=at, over=over, arg=arg, n_heads=n_heads, head_proj=head_proj
    )
    job = SweepJob.create(model, dst, metric, over_t, rows=rows, max_bytes=max_bytes)
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
        base_acts, base_out, _ = job.record({**dst, "use_cache": True} if cached else dst, chosen)
        prefix = CausalPrefix.from_run(dst, base_out) if cached else None
        baseline = job.score(drop_cache(base_out), chosen[0])
        del base_out
        results = [
            _layer_values(job, layer, (acts[layer.point], base_acts[layer.point]), baseline, prefix)
            for layer in chosen
        ]
    shapes = {tuple(r.shape) for r in results}
    if len(shapes) > 1:
        raise PatchingError(
            f"the layers give sweeps of different shapes {sorted(shapes)}; sweep them separately"
        )
    return torch.stack(results)


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
