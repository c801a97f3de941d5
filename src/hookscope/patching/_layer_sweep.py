"""One layer of a sweep: its sites in batched passes, the first pass of each kind checked against
one site patched alone, and fallbacks down to one site per pass (exact by construction).

Passes batch ``k`` sites as ``k`` copies of the batch's rows. Four ways to lay the rows out, in
the order tried (:class:`Rows`): from later positions (a causal model: a pass runs positions
``p0..`` only, the earlier ones from the corrupted run's key/value cache, rows fanned out from the
layer's block), fanned out (full length, rows from the layer's block on), tiled (the model's
inputs repeated ``k`` times), one site per pass. Each kind of pass that is not exact by
construction (a pass from a later position; a pass of several sites) is checked the first time
it runs, at its first and its last site (a model that mixes rows in their order, e.g. experts
filled to capacity by the earlier copies, leaves the first copy as alone): a pass from a later
position against a full run of the site (every output tensor), a pass of several sites against
the site run alone (the metric, and every output tensor of the site's rows). A check that
fails moves the layer to the next way, with one warning naming the layer and the reasons. A pass
that runs out of memory is split in two, and the sweep's passes stay at most that size.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core._errors import HookscopeError, HookscopeWarning
from ..core._nested import first_tensor, iter_tensors, map_tensors
from ..core._scope import HookScope
from ._batching import FanOut, plan, plan_from
from ._cached_prefix import CausalPrefix, drop_cache
from ._inputs import PatchingError
from ._job import SweepJob, check_calls
from ._sites import PatchedLayer, first_positions, patched, set_act, site_masks, view

__all__ = ["LayerSweep", "Mismatch", "Pass", "PrefixMismatch", "why_differ"]

_OOM = (torch.OutOfMemoryError,)


class Mismatch(HookscopeError):
    """A batched pass did not reproduce one site patched alone (the layer falls back)."""


class PrefixMismatch(Mismatch):
    """A pass from a later position (earlier ones from the cache) differs from a full run."""


@dataclass(frozen=True)
class Pass:
    """One forward: ``sites`` (indices into the layer's flattened sweep axes) as copies of the
    batch; with ``cache`` (a causal model's corrupted run) computing positions ``p0..`` only."""

    sites: tuple[int, ...]
    p0: int = 0
    cache: CausalPrefix | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Rows:
    """How a layer's passes lay out their rows: ``start`` where the copies fan out (``None``: the
    layer's block; ``""``: the model's inputs), ``cached`` passes from later positions."""

    start: str | None
    cached: bool = False


CACHED, FANNED, TILED = Rows(None, True), Rows(None), Rows("")


def why_differ(a: Any, b: Any, rows: int | None = None) -> str | None:
    """Why two outputs differ (structure, shapes, values beyond float noise), or ``None``. With
    ``rows``, only the tensors of ``rows`` rows in both are compared (one site's rows of a
    batched pass: a value the pass reduced over every copy, a loss, is the metric's check)."""
    ta, tb = list(iter_tensors(a)), list(iter_tensors(b))
    if [p for p, _ in ta] != [p for p, _ in tb]:
        return "the outputs hold different tensors"
    for (path, x), (_, y) in zip(ta, tb):
        name = ".".join(map(str, path)) or "output"
        if rows is not None and not (x.ndim and y.ndim and x.shape[0] == y.shape[0] == rows):
            continue
        if x.shape != y.shape:
            return f"{name} is {tuple(x.shape)}, not {tuple(y.shape)}"
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return f"{name} differs"
            continue
        tol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 3e-2
        xf, yf = x.float(), y.float()
        fx, fy = torch.isfinite(xf), torch.isfinite(yf)
        if not (bool(fx.all()) and bool(fy.all())):
            # the same NaN/inf in both (a metric of -inf, a NaN the model makes) is no difference
            if not torch.equal(fx, fy) or not torch.equal(
                xf[~fx].nan_to_num(), yf[~fy].nan_to_num()
            ):
                return f"{name} differs (other non-finite values)"
            xf, yf = xf[fx], yf[fy]
        diff = float((xf - yf).abs().max()) if xf.numel() else 0.0
        scale = float(yf.abs().max()) if yf.numel() else 0.0
        if not diff <= tol * (1.0 + scale):
            return f"{name} differs by {diff:.3g}"
    return None


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2
    fa, fb = float(a), float(b)
    if not (math.isfinite(fa) and math.isfinite(fb)):  # the same NaN or inf: the same value
        return fa == fb or (math.isnan(fa) and math.isnan(fb))
    return bool(abs(fa - fb) <= tol * (1.0 + abs(fb)))


def rows_of(out: Any, j: int, batch: int, total: int) -> Any:
    """Copy ``j``'s rows of a batched output (tensors whose leading dimension is ``total``)."""
    if total == batch:
        return out
    lo, hi = j * batch, (j + 1) * batch
    return map_tensors(lambda t: t[lo:hi] if t.ndim and t.shape[0] == total else t, out)


class _Patch:
    """The hook that writes the clean activation of a pass's sites into its copies of the rows."""

    def __init__(self, job: SweepJob, layer: PatchedLayer) -> None:
        self.job, self.layer = job, layer
        self.k, self.calls = 1, 0
        self.mask: torch.Tensor | None = None
        self.source = torch.empty(0)
        self.fan: FanOut | None = None  # the rows fanned out in the current way of batching

    def arm(self, k: int, mask: torch.Tensor | None, source: torch.Tensor) -> None:
        """Prepare a pass of ``k`` copies; ``mask`` picks each copy's sites from ``source``."""
        self.k, self.mask, self.source, self.calls = k, mask, source, 0
        if self.fan is not None:
            self.fan.reset(k)

    def _write(self, x: torch.Tensor) -> torch.Tensor:
        return patched(self.layer, self.mask, self.source, x, self.k)

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.calls += 1
        return set_act(self.layer, module, args, kwargs, None, self._write)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.calls += 1
        return set_act(self.layer, module, args, {}, output, self._write)


class LayerSweep:
    """The metric of each site of one layer (:meth:`values`): plan passes, run them, verify the
    first of each kind, fall back where a check fails.

    ``clean`` is the layer's activation in the source run, ``sizes`` the layer's sweep axes,
    ``prefix`` the corrupted run's cache (a causal model) or ``None``.
    """

    def __init__(
        self,
        job: SweepJob,
        layer: PatchedLayer,
        clean: torch.Tensor,
        sizes: tuple[int, ...],
        prefix: CausalPrefix | None = None,
    ) -> None:
        self.job, self.layer, self.clean, self.sizes, self.prefix = job, layer, clean, sizes, prefix
        self.ndim = view(layer, clean).ndim
        self.verified: set[str] = set()  # the kinds of pass checked in the current way
        self.failed: list[tuple[Rows, Mismatch]] = []
        self._patch = _Patch(job, layer)

    # -- the steps ------------------------------------------------------------------------
    def values(self, sites: list[int], differ: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The metric of each site in ``sites``, in that order. ``differ`` (where the clean and
        corrupted activations differ, heads split) lets a causal model run passes from later
        positions."""
        got = self._sweep(sites, differ)
        return [got[i] for i in sites]

    def _sweep(self, sites: list[int], differ: torch.Tensor | None) -> dict[int, torch.Tensor]:
        cached = self.plan_from_positions(sites, differ)
        if cached is not None:
            try:
                return self.run_passes(CACHED, cached)
            except PrefixMismatch as e:
                self._warn_full_length(e)
            except Mismatch as e:
                self.failed.append((CACHED, e))
        for rows in (FANNED, TILED):
            if (self.failed and rows is FANNED) or (rows is TILED and not self._start(FANNED)):
                continue  # fanning out already failed; or from the inputs, it is tiling
            try:
                got = self.run_passes(rows, self.plan(sites))
            except Mismatch as e:
                self.failed.append((rows, e))
                continue
            if self.failed:
                self._warn_fallback(rows)
            return got
        return self.fall_back(sites)

    def plan(self, sites: list[int]) -> list[Pass]:
        """Full-length passes of as many sites as the budget (or ``rows``) allows."""
        job = self.job
        parts = plan(
            len(sites), job.batch, bytes_per_row=job.per_row, rows=job.rows, budget=job.budget
        )
        return [Pass(tuple(sites[c.start : c.stop])) for c in parts]

    def plan_from_positions(
        self, sites: list[int], differ: torch.Tensor | None
    ) -> list[Pass] | None:
        """Passes that each run from their sites' first changed position on (a causal model's
        cache), or ``None`` where that does not apply (no cache; dim 1 is not the tokens)."""
        prefix, job = self.prefix, self.job
        if prefix is None or differ is None or differ.ndim < 3 or differ.shape[1] != prefix.length:
            return None
        length, cache_row = prefix.length, prefix.cache_bytes_per_row

        def row_bytes(p0: int) -> int:
            # the activations shrink with the positions; the keys and values of every layer do
            # not (the cache's, and a layer's own while it concatenates them: calibrated with
            # the profiler on GPT-2, as the full-length estimate)
            return job.per_row * (length - p0) // length + 2 * cache_row

        firsts = first_positions(self.layer, job.over, self.sizes, differ, sites)
        passes = plan_from(
            firsts,
            length,
            job.batch,
            bytes_per_row=row_bytes,
            rows=job.rows,
            budget=job.budget,
            shared=blocks_before_ratio(self.layer.start, job.block_names),
        )
        return [Pass(tuple(sites[i] for i in c), p0, prefix if p0 else None) for p0, c in passes]

    def run_passes(self, rows: Rows, passes: list[Pass]) -> dict[int, torch.Tensor]:
        """Run ``passes`` laid out as ``rows`` says; the first pass of each kind is verified
        (raises :class:`Mismatch`). A pass that runs out of memory is halved."""
        self.verified = set()
        values: dict[int, torch.Tensor] = {}
        # the first pass from a later position is checked against a full run, so it goes first:
        # where it batches several sites, that check covers the rows fanned out too
        first = next((i for i, p in enumerate(passes) if p.cache is not None), None)
        if first is not None:
            passes = [passes[first], *passes[:first], *passes[first + 1 :]]
        queue = deque(passes)
        with HookScope("patch_sweep") as scope:
            self._hooks(scope, rows)
            while queue:
                p = queue.popleft()
                cap = self.job.max_sites
                if cap is not None and len(p.sites) > cap:
                    queue.extendleft(reversed(_split(p, cap)))
                    continue
                try:
                    out = self._forward(p)
                except _OOM as e:
                    if len(p.sites) == 1:
                        raise
                    self._halve(p, e)
                    queue.appendleft(p)
                    continue
                values.update(self._scores(p, out))
        return values

    def verify(self, p: Pass, checked: dict[int, tuple[Any, torch.Tensor]]) -> None:
        """Check sites of ``p`` (``checked``: a copy's index in the pass -> its output rows and
        its metric) against each site patched alone in a full-length pass; raise
        :class:`Mismatch` where they differ."""
        for j, (rows, value) in checked.items():
            self._verify_site(p, p.sites[j], rows, value)
        self.verified |= _kinds(p)

    def _verify_site(self, p: Pass, site: int, rows: Any, value: torch.Tensor) -> None:
        alone = self._forward(Pass((site,)))
        if p.cache is not None:
            ref = p.cache.padding_from(drop_cache(alone), rows, p.p0)
            why = why_differ(rows, ref)
            if why is not None:
                raise PrefixMismatch(f"site {site} from position {p.p0} on: {why}")
        else:
            ref = self.job.score(alone, self.layer)
            if not _close(value, ref, self.clean.dtype):
                raise Mismatch(
                    f"the metric of site {site} was {float(value):.6g} batched and "
                    f"{float(ref):.6g} alone"
                )
            # every output tensor of the site's rows, not only what this metric reads: a copy
            # changed where the metric is not sensitive is changed where another site's is
            why = why_differ(rows, alone, rows=self.job.batch)
            if why is not None:
                raise Mismatch(f"site {site} batched and alone: {why}")

    def fall_back(self, sites: list[int]) -> dict[int, torch.Tensor]:
        """One site per pass, at full length: each pass is the reference itself."""
        values = self.run_passes(TILED, [Pass((i,)) for i in sites])
        self._warn_fallback(None)
        return values

    # -- one pass -------------------------------------------------------------------------
    def _start(self, rows: Rows) -> str:
        return self.layer.start if rows.start is None else rows.start

    def _hooks(self, scope: HookScope, rows: Rows) -> None:
        layer, job = self.layer, self.job
        start = self._start(rows)
        at = self.layer.start_at if rows.start is None else "input"
        self._patch.fan = FanOut(job.modules, start, job.batch, scope, at=at)
        module = job.modules[layer.point]
        if layer.kind == "input":
            scope.add_forward_pre(module, self._patch.pre, layer=layer.point, with_kwargs=True)
        else:
            scope.add_forward(module, self._patch.post, layer=layer.point)

    def _forward(self, p: Pass) -> Any:
        """The model's output for pass ``p`` (``k`` copies of the batch's rows)."""
        k, job = len(p.sites), self.job
        mask = site_masks(self.layer, job.over, self.sizes, p.sites, self.ndim)
        mask = None if mask is None else mask.to(self.clean.device)
        source, inputs = self.clean, job.dst
        if p.cache is not None:  # positions p0.. only: the activation and masks lose the others
            source, inputs = self.clean[:, p.p0 :], p.cache.inputs(p.p0)
            if mask is not None and mask.shape[2] == self.clean.shape[1]:
                mask = mask[:, :, p.p0 :]
        self._patch.arm(k, mask, source)
        try:
            out = job.model(**inputs)
            check_calls(self.layer, self._patch.calls)
        except _OOM:
            raise
        except Exception as e:
            if p.cache is not None:
                raise PrefixMismatch(f"{type(e).__name__}: {e}") from e
            if k == 1 or isinstance(e, PatchingError):
                raise
            raise Mismatch(f"{type(e).__name__}: {e}") from e
        lead = first_tensor(out)
        # also from a later position: a head that indexes its rows by the batch size of the
        # inputs (GPT-2's sequence classifier) returns the first copy's rows only
        if k > 1 and (lead is None or lead.ndim == 0 or lead.shape[0] != k * job.batch):
            shape = None if lead is None else tuple(lead.shape)
            raise Mismatch(f"the output's first tensor is {shape}, not {k * job.batch} rows")
        return out

    def _scores(self, p: Pass, out: Any) -> dict[int, torch.Tensor]:
        """Each site's metric from ``p``'s output; the first pass of a kind is verified at its
        first and its last copy (a model that mixes the rows of a batch in their order, e.g. a
        mixture of experts dropping the tokens past an expert's capacity across the batch,
        leaves the first copy as it is alone and changes the later ones)."""
        check = bool(_kinds(p) - self.verified)
        ends = {0, len(p.sites) - 1} if check else set()
        got, checked = [], {}
        for j in range(len(p.sites)):  # one site's rows at a time: a rebuilt output is a copy
            rows = self._site_rows(out, p, j)
            got.append(self.job.score(rows, self.layer))
            if j in ends:
                checked[j] = (rows, got[-1])
        del out, rows
        if check:
            self.verify(p, checked)
        return dict(zip(p.sites, got))

    def _site_rows(self, out: Any, p: Pass, j: int) -> Any:
        k, batch = len(p.sites), self.job.batch
        rows = rows_of(out, j, batch, k * batch)
        if p.cache is None:
            return rows
        try:
            return p.cache.rebuild(rows, p.p0)
        except Exception as e:
            raise PrefixMismatch(f"{type(e).__name__}: {e}") from e

    def _halve(self, p: Pass, e: BaseException) -> None:
        k, batch = len(p.sites), self.job.batch
        half = max(1, k // 2)
        self.job.max_sites = half
        if self.job.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        warnings.warn(
            f"patch_sweep: a pass of {k} sites ({k * batch} rows) at layer {self.layer.name!r} "
            f"ran out of memory ({str(e).splitlines()[0][:120]}); passes now hold at most {half} "
            f"sites ({half * batch} rows). Pass rows= or max_bytes= to set it",
            HookscopeWarning,
            stacklevel=5,
        )

    # -- warnings -------------------------------------------------------------------------
    def _warn_full_length(self, e: Mismatch) -> None:
        warnings.warn(
            f"patch_sweep: a pass over the later positions only (the earlier ones from the "
            f"corrupted run's key/value cache) did not reproduce a full run at layer "
            f"{self.layer.name!r} ({e}); that layer ran at full length instead (exact, slower)",
            HookscopeWarning,
            stacklevel=5,
        )

    def _warn_fallback(self, used: Rows | None) -> None:
        start = self._start(FANNED)
        where = repr(start) if start else "the model's inputs"
        text = [f"did not reproduce a site patched alone at layer {self.layer.name!r}"]
        for rows, e in self.failed:
            if rows is TILED:
                text.append(f"nor with the model's inputs tiled ({e})")
            else:
                text[0] += f" ({e})"
        if used is TILED:
            end = (
                "that layer ran with the model's inputs tiled instead (checked against a site "
                "patched alone: exact, slower)"
            )
        else:
            end = (
                "that layer ran one site per pass (exact, slower; a model that mixes the rows of "
                f"a batch, e.g. by a batch statistic, cannot batch sites: rows={self.job.batch} "
                "skips the batched attempts)"
            )
        warnings.warn(
            f"patch_sweep: rows batched from {where} on {', '.join(text)}; {end}",
            HookscopeWarning,
            stacklevel=5,
        )


def _kinds(p: Pass) -> set[str]:
    """What in a pass is not exact by construction: starting at a later position, several sites."""
    return ({"positions"} if p.cache is not None else set()) | (
        {"rows"} if len(p.sites) > 1 else set()
    )


def _split(p: Pass, k: int) -> list[Pass]:
    return [Pass(p.sites[i : i + k], p.p0, p.cache) for i in range(0, len(p.sites), k)]


def blocks_before_ratio(start: str, block_names: Sequence[str]) -> float:
    """The number of blocks before ``start`` over those from ``start`` on (0 where it is no
    block): what every pass recomputes once, in units of one site's rows."""
    if start not in block_names:
        return 0.0
    i = list(block_names).index(start)
    return i / (len(block_names) - i)
