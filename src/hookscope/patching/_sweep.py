"""``patch_sweep``: activation patching over layers x positions x heads, in batched passes."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._blocks import blocks
from ..core._compiled import named_modules
from ..core._errors import HookscopeWarning, LayerNotFoundError
from ..core._nested import first_tensor, iter_tensors, map_tensors
from ..core._prefix import CausalPrefix, drop_cache, wants_cache
from ..core._rows import FanOut, default_budget, plan, plan_from
from ..core._scope import HookScope, check_model, model_device
from ._inputs import PatchingError, as_kwargs, batch_size, check_aligned
from ._sites import (
    Site,
    first_positions,
    get_act,
    grid,
    patched,
    per_site,
    resolve_sites,
    set_act,
    site_masks,
    view,
)

__all__ = ["PatchMetric", "check_training", "patch_sweep", "prepare", "record", "sweep_layer"]

PatchMetric = Callable[[Any], Any]
"""``metric(output) -> scalar``: the model's output for one site's rows (as many rows as the
input batch; a tensor, or a ``ModelOutput`` with its ``.logits``)."""


class _Mismatch(Exception):
    pass


class _PrefixMismatch(_Mismatch):
    """A pass from a later position (earlier ones from the cache) differs from a full run."""


def prepare(
    model: nn.Module, clean: Any, corrupt: Any, reverse: bool
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The source run's and the patched run's keyword inputs, checked to align; the batch size."""
    check_model(model)
    src = as_kwargs(model, clean, "clean")
    dst = as_kwargs(model, corrupt, "corrupt")
    check_aligned(model, src, dst)
    if reverse:
        src, dst = dst, src
    return src, dst, batch_size(dst)


def record(
    model: nn.Module, kwargs: dict[str, Any], sites: list[Site], batch: int
) -> tuple[dict[str, torch.Tensor], int, Any]:
    """One forward: each site's activation (a copy), the bytes a row of a pass needs (on CUDA the
    forward's measured peak per row; elsewhere 24x the largest activation patched plus the
    model's output, per row), and the output."""
    modules = dict(named_modules(model))
    acts: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    scope = HookScope("patch_sweep")
    with scope:
        for site in sites:
            if site.point in acts:
                continue
            acts[site.point] = torch.empty(0)

            def keep(module: nn.Module, args: Any, kwargs: Any, output: Any = None, s=site) -> None:
                calls[s.point] = calls.get(s.point, 0) + 1
                acts[s.point] = get_act(s, module, args, kwargs, output).detach().clone()

            if site.kind == "input":
                scope.add_forward_pre(modules[site.point], keep, layer=site.point, with_kwargs=True)
            else:
                scope.add_forward(
                    modules[site.point],
                    lambda m, a, k, o, keep=keep: keep(m, a, k, o),
                    layer=site.point,
                    with_kwargs=True,
                )

        device = model_device(model)
        cuda = device.type == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        out = model(**kwargs)
    for site in sites:
        _check_calls(site, calls.get(site.point, 0))
    out_bytes = sum(t.nbytes for _, t in iter_tensors(out))
    if cuda:  # measured: the forward's peak on the device
        peak = torch.cuda.max_memory_allocated(device) - before
    else:  # estimated (calibrated with the profiler on GPT-2: peak <= budget), and the output
        peak = 24 * max(t.nbytes for t in acts.values()) + out_bytes
    return acts, peak // max(1, batch), out


def _check_calls(site: Site, n: int) -> None:
    if n == 1:
        return
    if n == 0:
        raise PatchingError(
            f"{site.point!r} never ran through module(...) in the forward pass, so it cannot be "
            "patched (PyTorch runs hooks only through __call__; e.g. nn.MultiheadAttention calls "
            "its out_proj's weights directly). Select a layer that runs"
        )
    raise PatchingError(
        f"{site.point!r} ran {n} times in one forward pass; a patch would change every call. "
        "Select a module that runs once"
    )


def _scalar(value: Any, layer: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.ndim != 0:
        raise PatchingError(
            f"metric must return a scalar (one number for the batch, as in TransformerLens); "
            f"it returned shape {tuple(t.shape)} at layer {layer!r}. Reduce it, e.g. .mean()"
        )
    return t.detach().to(torch.float32)


def rows_of(out: Any, j: int, batch: int, total: int) -> Any:
    """Copy ``j``'s rows of a batched output (tensors whose leading dimension is ``total``)."""
    if total == batch:
        return out
    lo, hi = j * batch, (j + 1) * batch
    return map_tensors(lambda t: t[lo:hi] if t.ndim and t.shape[0] == total else t, out)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2
    return bool(abs(float(a) - float(b)) <= tol * (1.0 + abs(float(b))))


def _same(a: Any, b: Any) -> str | None:
    """Why two outputs differ (structure, shapes, values beyond float noise), or ``None``."""
    ta, tb = list(iter_tensors(a)), list(iter_tensors(b))
    if [p for p, _ in ta] != [p for p, _ in tb]:
        return "the outputs hold different tensors"
    for (path, x), (_, y) in zip(ta, tb):
        name = ".".join(map(str, path)) or "output"
        if x.shape != y.shape:
            return f"{name} is {tuple(x.shape)}, not {tuple(y.shape)}"
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return f"{name} differs"
            continue
        tol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 3e-2
        diff = float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
        scale = float(y.float().abs().max()) if y.numel() else 0.0
        if not diff <= tol * (1.0 + scale):  # NaN fails too
            return f"{name} differs by {diff:.3g}"
    return None


def _sweep_site(
    model: nn.Module,
    dst: dict[str, Any],
    site: Site,
    over: tuple[str, ...],
    sizes: tuple[int, ...],
    passes: list[tuple[int, Sequence[int]]],
    clean: torch.Tensor,
    metric: PatchMetric,
    batch: int,
    start: str,
    start_at: Literal["input", "output"],
    verify: bool,
    prefix: CausalPrefix | None = None,
) -> dict[int, torch.Tensor]:
    modules = dict(named_modules(model))
    module = modules[site.point]
    state: dict[str, Any] = {"k": 1, "mask": None, "calls": 0, "clean": clean}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return patched(site, state["mask"], state["clean"], x, state["k"])

    def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
        state["calls"] += 1
        return set_act(site, module, args, kwargs, None, fn)

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        state["calls"] += 1
        return set_act(site, module, args, {}, output, fn)

    ndim = view(site, clean).ndim
    device = clean.device
    values: dict[int, torch.Tensor] = {}
    with HookScope("patch_sweep") as scope:
        fan = FanOut(model, start, batch, scope, at=start_at)
        if site.kind == "input":
            scope.add_forward_pre(module, pre, layer=site.point, with_kwargs=True)
        else:
            scope.add_forward(module, post, layer=site.point)

        def run(chunk: Sequence[int], p0: int = 0) -> Any:
            k = len(chunk)
            fan.reset(k)
            state.update(k=k, calls=0, clean=clean)
            mask = site_masks(site, over, sizes, chunk, ndim)
            mask = None if mask is None else mask.to(device)
            if p0:  # positions p0.. only: the activation and the masks lose the earlier ones
                assert prefix is not None
                state["clean"] = clean[:, p0:]
                if mask is not None and mask.shape[2] == clean.shape[1]:
                    mask = mask[:, :, p0:]
                state["mask"] = mask
                try:
                    out = model(**prefix.inputs(p0))
                    _check_calls(site, state["calls"])
                except Exception as e:
                    raise _PrefixMismatch(f"{type(e).__name__}: {e}") from e
                return out
            state["mask"] = mask
            try:
                out = model(**dst)
            except PatchingError:
                raise
            except Exception as e:
                if k == 1:
                    raise
                raise _Mismatch(f"{type(e).__name__}: {e}") from e
            _check_calls(site, state["calls"])
            lead = first_tensor(out)
            if k > 1 and (lead is None or lead.ndim == 0 or lead.shape[0] != k * batch):
                shape = None if lead is None else tuple(lead.shape)
                raise _Mismatch(f"the output's first tensor is {shape}, not {k * batch} rows")
            return out

        def site_rows(out: Any, j: int, k: int, p0: int) -> Any:
            rows = rows_of(out, j, batch, k * batch)
            if not p0:
                return rows
            assert prefix is not None
            try:
                return prefix.rebuild(rows, p0)
            except Exception as e:
                raise _PrefixMismatch(f"{type(e).__name__}: {e}") from e

        # the first pass from a later position is checked against a full run of its first
        # site, so it goes first; where it batches several sites, that check covers the rows
        # fanned out too, and the full-length passes need no check of their own
        first = next((i for i, (p0, _) in enumerate(passes) if p0), None)
        if verify and first is not None:
            passes = [passes[first], *passes[:first], *passes[first + 1 :]]
        checked = checked_prefix = False
        if verify and first is not None and len(passes[0][1]) > 1:
            checked = True
        for p0, chunk in passes:
            k = len(chunk)
            out = run(chunk, p0)
            check = verify and p0 and not checked_prefix
            got, first_rows = [], None
            for j in range(k):  # one site's rows at a time: a rebuilt output is a copy
                rows = site_rows(out, j, k, p0)
                if check and j == 0:
                    first_rows = rows
                got.append(_scalar(metric(rows), site.layer))
            del out, rows
            if check:
                checked_prefix = True
                assert prefix is not None
                ref = prefix.padding_from(drop_cache(run([chunk[0]])), first_rows, p0)
                why = _same(first_rows, ref)
                if why is not None:
                    raise _PrefixMismatch(f"site {chunk[0]} from position {p0} on: {why}")
                del ref, first_rows
            if verify and not p0 and not checked and k > 1:
                checked = True
                ref = _scalar(metric(run([chunk[0]])), site.layer)
                if not _close(got[0], ref, clean.dtype):
                    raise _Mismatch(
                        f"the metric of site 0 was {float(got[0]):.6g} batched and "
                        f"{float(ref):.6g} alone"
                    )
            values.update(zip(chunk, got))
    return values


def sweep_layer(
    model: nn.Module,
    dst: dict[str, Any],
    site: Site,
    over: tuple[str, ...],
    sizes: tuple[int, ...],
    chunks: list[Sequence[int]],
    clean: torch.Tensor,
    metric: PatchMetric,
    batch: int,
    fast: tuple[CausalPrefix, list[tuple[int, list[int]]]] | None = None,
) -> list[torch.Tensor]:
    """The metric of each site in ``chunks`` (one pass per chunk; in the order of ``chunks``) at
    one layer. With ``fast`` (a causal model's cache and passes ``(p0, sites)``), each pass runs
    positions ``p0..`` only, the earlier ones from the corrupted run's keys and values; where
    its first such pass does not reproduce a full run, the layer runs at full length, with a
    warning. At full length, rows fan out from the site's block, or, where that does not
    reproduce a site patched alone, from the model's inputs (tiled), with a warning."""
    order = [i for c in chunks for i in c]
    args = (model, dst, site, over, sizes)
    tail = (clean, metric, batch)
    fan_ok = True
    if fast is not None:
        prefix, passes = fast
        try:
            got = _sweep_site(*args, passes, *tail, site.start, site.start_at, True, prefix)
            return [got[i] for i in order]
        except _PrefixMismatch as e:
            warnings.warn(
                f"patch_sweep: a pass over the later positions only (the earlier ones from the "
                f"corrupted run's key/value cache) did not reproduce a full run at layer "
                f"{site.layer!r} ({e}); that layer ran at full length instead (exact, slower)",
                HookscopeWarning,
                stacklevel=3,
            )
        except _Mismatch as e:
            fan_ok, err = False, e
    full = [(0, c) for c in chunks]
    if fan_ok:
        try:
            got = _sweep_site(*args, full, *tail, site.start, site.start_at, verify=True)
            return [got[i] for i in order]
        except _Mismatch as e:
            err = e
    warnings.warn(
        f"patch_sweep: rows batched from {site.start!r} on did not reproduce a site patched "
        f"alone at layer {site.layer!r} ({err}); that layer ran with the model's inputs tiled "
        "instead (exact, slower)",
        HookscopeWarning,
        stacklevel=3,
    )
    try:
        got = _sweep_site(*args, full, *tail, "", "input", verify=False)
        return [got[i] for i in order]
    except _Mismatch as e2:
        raise PatchingError(
            f"patch_sweep at layer {site.layer!r}: the model fails on a batch of several copies "
            f"of its inputs ({e2}); pass rows= equal to the batch size to run one site per pass"
        ) from e2


def _fast_passes(
    prefix: CausalPrefix | None,
    site: Site,
    over: tuple[str, ...],
    sizes: tuple[int, ...],
    differ: torch.Tensor,
    todo: list[int],
    batch: int,
    per_row: int,
    rows: int | None,
    budget: int,
    shared: float,
) -> tuple[CausalPrefix, list[tuple[int, list[int]]]] | None:
    """The passes ``(p0, sites)`` of a layer whose sites run from their first changed position
    on (a causal model's cache), or ``None`` where the activation's dim 1 is not the tokens.
    ``shared``: the blocks before the rows fan out over those from there on (each pass runs
    them once on the batch)."""
    if prefix is None or differ.ndim < 3 or differ.shape[1] != prefix.length:
        return None
    length, cache_row = prefix.length, prefix.cache_bytes_per_row

    def row_bytes(p0: int) -> int:
        # the activations shrink with the positions; the keys and values of every layer do not
        # (the cache's, and a layer's own while it concatenates them: calibrated with the
        # profiler on GPT-2, as the full-length estimate)
        return per_row * (length - p0) // length + 2 * cache_row

    firsts = first_positions(site, over, sizes, differ, todo)
    passes = plan_from(
        firsts, length, batch, bytes_per_row=row_bytes, rows=rows, budget=budget, shared=shared
    )
    return prefix, [(p0, [todo[i] for i in c]) for p0, c in passes]


def _block_names(model: nn.Module) -> list[str]:
    try:
        return list(blocks(model))
    except LayerNotFoundError:
        return []


def _before(start: str, block_names: list[str]) -> float:
    """The blocks before ``start`` over those from ``start`` on (0 where it is no block)."""
    if start not in block_names:
        return 0.0
    i = block_names.index(start)
    return i / (len(block_names) - i)


def check_training(model: nn.Module, what: str) -> None:
    """Refuse a model in training mode where that changes values: active dropout (every run
    differs) or batch norm (batch statistics would mix the rows of different sites)."""
    for name, m in named_modules(model):
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            why = f"dropout ({name!r}, p={m.p}) makes every run differ, so a patch's effect would be noise"
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            why = f"batch norm ({name!r}) normalises with the batch's statistics, which would mix the rows of different sites"
        else:
            continue
        raise PatchingError(
            f"{what}: the model is in training mode and {why}; call model.eval() first"
        )


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
    src, dst, batch = prepare(model, clean, corrupt, reverse)
    check_training(model, "patch_sweep")
    sites, over_t = resolve_sites(
        model, layers, at=at, over=over, arg=arg, n_heads=n_heads, head_proj=head_proj
    )
    budget = max_bytes if max_bytes is not None else default_budget(model_device(model))
    results = []
    with torch.no_grad():
        acts, per_row, _ = record(model, src, sites, batch)
        if max_bytes is not None and rows is None and per_row * batch > max_bytes:
            warnings.warn(
                f"patch_sweep: max_bytes={max_bytes} is less than one site's pass over the whole "
                f"sequence needs (about {per_row * batch} bytes for {batch} rows); sites run one "
                "per pass, and a pass may go over max_bytes. Raise max_bytes or use a smaller batch",
                HookscopeWarning,
                stacklevel=2,
            )
        cached = wants_cache(model, dst)
        base_acts, _, base_out = record(
            model, {**dst, "use_cache": True} if cached else dst, sites, batch
        )
        prefix = CausalPrefix.from_run(dst, base_out) if cached else None
        base_out = drop_cache(base_out)
        baseline = _scalar(metric(base_out), sites[0].layer)
        del base_out
        block_names = _block_names(model) if prefix is not None else []
        for site in sites:
            clean_act, base_act = acts[site.point], base_acts[site.point]
            if clean_act.shape != base_act.shape:
                raise PatchingError(
                    f"the activation of {site.point!r} is {tuple(clean_act.shape)} in the clean "
                    f"run and {tuple(base_act.shape)} in the corrupted run: they do not align"
                )
            sizes = grid(site, over_t, clean_act.shape)
            # a site whose clean values equal the corrupted ones changes nothing: its run is the
            # corrupted run (e.g. every position before the first differing token, causally)
            differ = view(site, clean_act != base_act)
            todo = per_site(site, over_t, differ, torch.any).flatten().nonzero().flatten().tolist()
            full = baseline.to(clean_act.device).repeat(math.prod(sizes))
            if todo:
                parts = plan(len(todo), batch, bytes_per_row=per_row, rows=rows, budget=budget)
                chunks = [todo[c.start : c.stop] for c in parts]
                shared = _before(site.start, block_names)
                fast = _fast_passes(
                    prefix, site, over_t, sizes, differ, todo, batch, per_row, rows, budget, shared
                )
                vals = sweep_layer(
                    model, dst, site, over_t, sizes, chunks, clean_act, metric, batch, fast
                )
                full[todo] = torch.stack(vals).to(full.device)
            results.append(full.view(sizes))
    shapes = {tuple(r.shape) for r in results}
    if len(shapes) > 1:
        raise PatchingError(
            f"the layers give sweeps of different shapes {sorted(shapes)}; sweep them separately"
        )
    return torch.stack(results)
