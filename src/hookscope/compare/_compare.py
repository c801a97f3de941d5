"""``hs.compare``: where run B first drifts from run A, and which module made the error."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import compiled_regions, named_modules, named_parameters
from ..core._errors import HookscopeWarning, some_names
from ..core._nested import SCALARS, continuous, hidden_tensors, iter_tensors, tensors_of
from ..core._scope import internal_run
from ._checks import (
    check_arguments,
    check_hooks_ran,
    check_kinds,
    check_loss,
    check_modes,
    check_names,
    check_quantized,
)
from ._forced import Forced, forced_pass
from ._ranks import shapes_from
from ._record import load_record, unwrapped, weights_crc
from ._replay import CopiesIn, Replay, Result
from ._report import CompareReport, CompareRow
from ._run import (
    CallRec,
    CompareError,
    RunRecord,
    RunSpec,
    _autocast,
    _device,
    at_path,
    cast_like,
    model_dtype,
    preserved,
    record_run,
    restore_aliases,
)
from ._tolerance import (
    Norms,
    float_error,
    has_integers,
    int_numbers,
    lower,
    reduction_size,
    rel_error,
    rel_pairs,
    tolerance,
    value,
    worst,
)

__all__ = ["compare"]

Names = Mapping[str, str | None] | Callable[[str], str | None] | None


def _name_map(names: Names) -> Callable[[str], str | None]:
    if names is None:
        return lambda n: n
    if callable(names):
        return names
    table = dict(names)
    return lambda n: table.get(n, n)


class _Job:
    """One comparison: A's record, B's record (or live B), the replays, the rows."""

    def __init__(
        self, ra: RunRecord, rb: RunRecord | None, b: nn.Module | None, names: Names
    ) -> None:
        self.ra, self.rb, self.b = ra, rb, b
        self.map = _name_map(names)
        self.grads = ra.has_grads and (rb is None or rb.has_grads)
        da = ra.run_dtype
        db = rb.run_dtype if rb is not None else da
        self.low = lower(da, db)
        self.mixed = da != db
        self.failed: list[str] = []
        self.shared = _shared_params(ra, b)
        # the end of a run of the comparison (hs.compare's young collection: _YoungCollections)
        self.phase: Callable[[], None] = _nothing
        # the rows' errors are computed together, once every row is replayed (then verdicts)
        self.norms = norms = Norms()
        # the calls some of whose gradients PyTorch never handed over, per run
        self.lost_a, self.lost_b = _lost_calls(ra), _lost_calls(rb)
        # A's calls whose output gradient (the seed of their local backward) was lost, and
        # those whose input gradient (what their caller's local backward gets back) was
        self.lost_seed = _lost_calls(ra, "grad")
        self.lost_in = _lost_calls(ra, "ingrad")
        # A's calls enclosing a value the recorded loss used directly -> that call
        self.aux: dict[int, int] = {}
        for pos in sorted(ra.loss_inside):
            p = ra.calls[pos].parent if pos < len(ra.calls) else None
            while p is not None:
                self.aux.setdefault(p, pos)
                p = ra.calls[p].parent
        self.rep_b = self.rep_a = self.rep_bc = self.rep_round = None
        self.rep_stand: Replay | None = None
        if rb is not None and rb.modules is not None:
            self.rep_b = Replay(rb.modules, ra, rb, self.map, rb.dtype, rb.autocast, norms=norms)
            if rb.compiled:
                self.rep_bc = Replay(
                    rb.modules, rb, rb, lambda n: n, rb.dtype, rb.autocast, norms=norms
                )
        # B's regions compiled with fullgraph=True: hooks cannot run inside one, so its calls
        # ran eagerly while recorded; its compiled code is run as a whole on the same inputs
        self.fullgraph: dict[str, Any] = {}
        if b is not None and rb is not None and rb.compiled:
            for region in compiled_regions(b):
                if region.fullgraph and region._owner() is not None:
                    self.fullgraph[region.name] = region._owner()
        if ra.modules is not None and self.grads:
            self.rep_a = Replay(ra.modules, ra, ra, lambda n: n, ra.dtype, ra.autocast, norms=norms)
        self.forced: Forced | None = None
        # rows whose parameter gradients were compared with A's whole .grad: A's call ->
        # (the row's other gradient errors, A's calls those gradients add up, B's module's own
        # gradients over those calls), checked against A's own replay of those calls where the
        # row's gradient error is over tolerance
        self._whole: dict[int, tuple[list[Any], list[int], dict[str, Any]]] = {}
        self.notes: list[str] = []  # for the report's notes
        # rows whose calls computed in a lower dtype than the models' (a mixed-precision model:
        # an embedding kept in fp32, the rest in bf16): that dtype (see _call_low)
        self._lows: dict[int, torch.dtype] = {}
        # rows whose output holds tensors inside objects (hidden_tensors): their error there, and
        # the objects' classes; the labels of those that differ beyond the row's tolerance
        self._hidden: dict[int, tuple[Any, list[str]]] = {}
        self.hidden_calls: list[tuple[int, str]] = []  # (A's call, its label)
        # a gradient one run has and the other has not counts as a zero one (a module that stops
        # the gradient is named); a compiled run has none for outputs nothing depends on, so
        # there only gradients both runs have are compared
        self.missing = not (
            ra.compiled
            or ra.partial_grads
            or (rb is not None and (rb.compiled or rb.partial_grads))
        )
        self._names_cache: dict[tuple[str, str | None], tuple[dict[str, str], str | None]] = {}
        self._by_owner: dict[int, dict[str, list[str]]] = {}  # id(record) -> owner -> params
        # B's replayed output of the calls whose output holds integers (a router's indices):
        # where those differ in B and in the reference alike, their floating outputs decide
        self._int_out: dict[int, Any] = {}
        # False while a backward is judged after the forward's error was explained: a check whose
        # reference cannot be computed then leaves the row unflagged, with a note
        self._strict = True
        # the conditioning checks of calls computed in a lower dtype than the models' (a
        # mixed-precision model), by that dtype: rounding A's values, A's modules in it
        self._rounds: dict[torch.dtype, Replay] = {}
        self._low_replays: dict[torch.dtype | None, Replay] = {}  # (None: B's own dtype)
        # id(row) -> the backward part of its compile_error (lazy until the norms resolve)
        self._compiled_back: dict[int, Any] = {}
        if self.mixed and (ra.modules is not None or b is not None):
            # the conditioning check replays A's modules; for a recorded A, a copy of B's in
            # A's dtype stands in for them
            mods = ra.modules
            if mods is None and b is not None:
                mods = CopiesIn(dict(named_modules(b)), ra.dtype)
                rename = self.map
            else:
                rename = lambda n: n  # noqa: E731
            assert mods is not None
            self.rep_round = Replay(mods, ra, ra, rename, ra.dtype, ra.autocast, round_to=self.low)
            if ra.modules is None:
                # the stand-in for a recorded A (B's copy in A's dtype, a fault of B's included):
                # its rounding and dtype effects are measured against itself on A's own values,
                # never against A's output (where B's fault would show as much)
                self.rep_stand = Replay(mods, ra, ra, rename, ra.dtype, ra.autocast)

    # -- matching ------------------------------------------------------------------------------
    def pairs(self) -> tuple[list[tuple[int, int]], list[str]]:
        ra, rb = self.ra, self.rb
        assert rb is not None
        matched, unmatched, used = [], [], set()
        for i, c in enumerate(ra.calls):
            bn = self.map(c.name)
            j = rb.by_key.get((bn, c.index)) if bn is not None else None
            why = ra.excluded.get(c.name) or (rb.excluded.get(bn) if bn is not None else None)
            if j is None or why:
                unmatched.append(
                    f"a: {c.name or '<root>'}#{c.index}" + (f" ({why})" if why else "")
                )
                continue
            matched.append((i, j))
            used.add(j)
        for j, c in enumerate(rb.calls):
            if j not in used:
                why = rb.excluded.get(c.name)
                unmatched.append(
                    f"b: {c.name or '<root>'}#{c.index}" + (f" ({why})" if why else "")
                )
        return matched, unmatched

    def force(self) -> None:
        """Every call of B replayed on A's values in one forward and backward (:mod:`._forced`),
        where that is exactly the per-call replay; the other rows replay one by one."""
        rb = self.rb
        if self.rep_b is None or rb is None or rb.compiled or rb.modules is None:
            return
        names = {id(m): n for n, m in rb.modules.items()}
        self.forced = forced_pass(self.rep_b, names, self.grads)

    def _forced(self, i: int) -> Result | None:
        """The forced pass's result for A's call ``i`` (its parameter gradients: the module's own,
        summed over its calls, on its first call's row), or ``None``: replay it by itself."""
        f = self.forced
        if f is None or f.void or i in f.dirty:
            return None
        got = f.results.get(i)
        if got is None:
            return None
        ca = self.ra.calls[i]
        bname = self.map(ca.name)
        module = self.rep_b.modules.get(bname) if self.rep_b and bname is not None else None
        if module is None or bname in f.unforced:
            return None
        pre_a = f"{ca.name}." if ca.name else ""
        own = _own_params(module)
        own += f.adopted.get(bname, [])  # its children's that never run as modules
        if any(pre_a + n in self.shared for n in own):
            return None  # tied weights: the sums mix modules; per call, A replayed too
        if self.grads and got.in_grads is not None:
            pre_b = f"{bname}." if bname else ""
            got.param_grads = (
                {n: f.param_grads[pre_b + n] for n in own if pre_b + n in f.param_grads}
                if ca.index == 0
                else {}
            )
        return got

    # -- one row -------------------------------------------------------------------------------
    def row(self, i: int, j: int) -> CompareRow:
        """The row of A's call ``i`` and B's call ``j``, its errors still lazy (:meth:`finish`)."""
        ra, rb = self.ra, self.rb
        assert rb is not None
        ca, cb = ra.calls[i], rb.calls[j]
        module = (ra.modules or {}).get(ca.name) or (rb.modules or {}).get(cb.name)
        params = (
            [p for p in module._parameters.values() if p is not None] if module is not None else []
        )
        norms = self.norms
        r = CompareRow(
            name=ca.name,
            index=ca.index,
            kind=type(module).__name__ if module is not None else "?",
            depth=_depth(ra, i),
            end=ca.end,
            tol=0.0,
            b_name=cb.name if cb.name != ca.name else None,
        )
        low = self._call_low(ca, cb, params, (rb.modules or {}).get(cb.name))
        r.tol = tolerance(low, reduction_size(ca.inputs, params))
        if low != self.low:
            self._lows[id(r)] = low
        r.error = norms.rel_error(ca.output, cb.output)
        if ca.output is not None and ca.output.__class__ is not torch.Tensor:
            self._hidden_error(r, ca.output, cb.output)
            said = _other_structure(ca.output, cb.output)
            if said:
                r.note = f"{r.note}; {said}" if r.note else said
        if self.grads:
            ga, gb = ca.grad, cb.grad
            if ga is not None and gb is not None:
                r.grad_error = norms.rel_pairs(list(zip(ga, gb)), self.missing)
        if ca.index == 0 and self.grads:  # (a run without backward has none to compare)
            r.param_grad_error = self._param_grads(ca.name, cb.name)
        self._local(i, r)
        lost = [
            side for side, calls, k in (("a", self.lost_a, i), ("b", self.lost_b, j)) if k in calls
        ]
        if lost and self.grads:
            why = (
                f"no gradient recorded for some of its values in {' and '.join(lost)} (changed "
                "in place after they were handed on: PyTorch drops a gradient hook on a view "
                "changed in place); its gradient errors cover only the gradients both runs have"
            )
            r.note = f"{r.note}; {why}" if r.note else why
        if self.rep_bc is not None:
            # compiled vs eager, B's module run eagerly on the compiled run's own values: the
            # output, what the call handed its children (a compiled-only change in the module's
            # own code before a child's call) and, with a backward, its input gradients from
            # the compiled run's output gradient and what it handed back to its children
            note, failed = r.note, len(self.failed)
            got = self._run(self.rep_bc, j, self.grads, r) if self.grads else None
            if got is None:  # (a backward that cannot replay: its forward still says what differs)
                r.note = note
                del self.failed[failed:]
                got = self._run(self.rep_bc, j, False, r)
            if got is not None:
                errs = [norms.rel_error(got.output, cb.output), *got.child_errors]
                if (
                    got.in_grads is not None
                    and cb.in_grad is not None
                    and not got.in_place
                    and not cb.children
                ):
                    # a leaf call's own input gradients only, where the compiled run gave one
                    # that is not all zeros: around in-place ops (an in-place ReLU, a block's
                    # `out += identity`) the compiled run's recorded input gradients of a call
                    # are not the call's (zeros; a fault-free compiled resnet18's blocks read 60%)
                    pairs = [
                        (g, e)
                        for g, e in zip(cb.in_grad, got.in_grads)
                        if g is not None and e is not None and bool(g.detach().abs().amax() > 0)
                    ]
                    if pairs:
                        back = norms.rel_pairs(pairs, False)
                        errs.append(back)
                        self._compiled_back[id(r)] = back
                r.compile_error = worst(errs)
        if cb.name in self.fullgraph and cb.inputs is not None:
            self._whole_region(cb, r)
        return r

    def _call_low(
        self, ca: CallRec, cb: CallRec, params: list[torch.Tensor], module_b: nn.Module | None
    ) -> torch.dtype:
        """The least precise floating dtype a call computed in, in either run: the models' run
        dtypes (the dtype of each one's first floating parameter, or autocast's), and those of
        the call's own parameters, inputs and outputs. A model whose first parameter is kept in
        fp32 and whose other modules are bf16 reads as fp32; its bf16 modules' rounding was
        judged against fp32's tolerance (a fault-free mixed-precision copy had a culprit)."""
        low = self.low
        dts: set[torch.dtype] = set()
        for c, own in ((ca, params), (cb, module_b._parameters.values() if module_b else ())):
            # the dtypes of the inputs where only those are kept (B's); A's inputs, kept whole,
            # are the outputs of the calls before (their rows see those dtypes)
            ins = c.in_dtypes
            if ins:
                dts.update(ins)
            out = c.output
            if out.__class__ is torch.Tensor:
                dts.add(out.dtype)
            elif out is not None:
                dts.update(t.dtype for t in tensors_of(out))
            dts.update(p.dtype for p in own if p is not None)
        for d in dts:
            if d is not low and d.is_floating_point and d != torch.float64:
                low = lower(low, d)
        return low

    def _hidden_error(self, r: CompareRow, a: Any, b: Any) -> None:
        """The tensors an output holds inside objects (a ``Box(h)`` a module returns, a cache):
        compared in the row's ``error`` (both runs' own outputs), never handed on by the replays
        (a module growing a cache its children got would read as an error of its own)."""
        ha, classes = hidden_tensors(a)
        if not ha:
            return
        hb, _ = hidden_tensors(b)
        h = math.inf if len(ha) != len(hb) else self.norms.rel_pairs(list(zip(ha, hb)))
        r.error = worst([r.error, h])
        self._hidden[id(r)] = (h, classes)

    def _hidden_over(self, i: int, r: CompareRow, h: float, classes: list[str]) -> None:
        """Tensors inside objects of the row's output differ beyond its tolerance: its local
        errors do not cover them (the replays hand on only the tensors the nested walk sees), so
        its local error is unknown where the visible part is within tolerance, and the row and
        the report say so."""
        what = ", ".join(sorted(set(classes))[:3]) or "an object"
        why = (
            f"its output holds tensors inside {what} that differ by {h:.1e}: the replays hand "
            "on and compare only the tensors of tuples, lists, dicts and dataclasses, so its "
            "local error does not cover them"
        )
        if r.local_error is None or r.local_error <= r.tol:
            r.local_error = None
        r.note = f"{r.note}; {why}" if r.note else why
        self.hidden_calls.append((i, r.label))

    def finish(self, i: int, j: int, r: CompareRow) -> CompareRow:
        """Once the norms are computed: the row's errors as numbers, its verdict."""
        for field in _ERRORS:
            setattr(r, field, value(getattr(r, field)))
        hidden = self._hidden.pop(id(r), None)
        if hidden is not None:
            h = value(hidden[0])
            if h is not None and h > r.tol:
                self._hidden_over(i, r, h, hidden[1])
        self._verdict(i, r)
        self._unjoined(i, j, r)
        self._per_rank_statistics(i, j, r)
        return r

    def _whole_region(self, cb: CallRec, r: CompareRow) -> None:
        """A region compiled with fullgraph=True, whose calls ran eagerly under the record's
        hooks: its compiled code (no hook inside) run on the inputs the call got, against the
        call's eager output, is what compilation adds inside it (its modules' rows are of its
        eager run)."""
        rb = self.rb
        assert rb is not None
        args, kwargs = restore_aliases(cb.inputs, cb.alias)
        device = _device(self.fullgraph[cb.name])
        try:
            with torch.no_grad(), _autocast(device, rb.autocast):
                out = self.fullgraph[cb.name](*args, **kwargs)
        except Exception as exc:  # say so in the row, as for a replay
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            r.note = f"its compiled code (fullgraph=True) could not run alone: {msg[:160]}"
            self.failed.append(r.label)
            return
        err = self.norms.rel_error(cb.output, out)
        r.compile_error = worst([r.compile_error, err]) if r.compile_error is not None else err
        why = (
            "compiled with fullgraph=True: hooks cannot run inside it, so its modules' rows are "
            "of its eager run; compile_error compares its compiled code as a whole"
        )
        r.note = f"{r.note}; {why}" if r.note else why

    def _per_rank_statistics(self, i: int, j: int, r: CompareRow) -> None:
        """A BatchNorm in training mode, in a record of several ranks: each rank normalised its
        share by that share's own statistics, a computation of its own that one process on the
        combined batch does not make: said in the row, so its flag reads as what it is."""
        ra, rb = self.ra, self.rb
        assert rb is not None
        ranks = ra if ra.world > 1 else rb if rb.world > 1 else None
        if ranks is None:
            return
        module = (ra.modules or {}).get(ra.calls[i].name) or (rb.modules or {}).get(
            rb.calls[j].name
        )
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or isinstance(
            module, nn.SyncBatchNorm
        ):
            return
        name = (ranks.calls[i] if ranks is ra else ranks.calls[j]).name
        mode = (ranks.modes or {}).get(name)
        training = bool(mode[0]) if mode else module.training
        if not training:
            return
        why = (
            f"BatchNorm in training mode on {ranks.world} ranks: each rank normalised its share "
            "of the batch by that share's own statistics, which one process on the combined "
            "batch does not (a difference by construction, not a fault); use SyncBatchNorm, or "
            "record in eval mode, to compare it"
        )
        r.note = f"{r.note}; {why}" if r.note else why

    def _unjoined(self, i: int, j: int, r: CompareRow) -> None:
        """Rows of a record of several ranks whose values could not be joined: no errors, no
        verdict; a call whose replay stood in such a child's value: no local errors."""
        ra, rb = self.ra, self.rb
        assert rb is not None
        unjoined = ra.notes.get(i) or rb.notes.get(j)
        if unjoined:
            r.note, r.flagged = unjoined, None
            r.error = r.local_error = r.grad_error = r.local_grad_error = None
            return
        child = next((k for k in ra.calls[i].children if k in ra.notes), None)
        if child is not None:
            c = ra.calls[child]
            r.note = f"no local error: its call of {c.name}#{c.index} cannot be joined across ranks"
            r.flagged = r.local_error = r.local_grad_error = None

    def _param_grads(self, a_name: str, b_name: str) -> float | None:
        ra, rb = self.ra, self.rb
        assert rb is not None
        to_a, _ = self._own_names(a_name, b_name)
        to_b = {v: k for k, v in to_a.items()}
        pairs = []
        for p in self._params_of(ra).get(a_name, ()):
            local = p[len(a_name) + 1 :] if a_name else p
            if local not in to_b:  # no counterpart in B's module (said in the row's note)
                continue
            q = f"{b_name}.{to_b[local]}" if b_name else to_b[local]
            if p in ra.outside or q in rb.outside:  # a loss term on it in one record
                continue
            pairs.append((ra.param_grads.get(p), rb.param_grads.get(q)))
        return self.norms.rel_pairs(pairs, self.missing) if pairs else None

    def _params_of(self, rec: RunRecord) -> dict[str, list[str]]:
        """Each module's own parameters (full names, in ``rec.params``'s order) in ``rec``, made
        once per record: a scan of all the parameters per row was quadratic in the model."""
        got = self._by_owner.get(id(rec))
        if got is None:
            got = self._by_owner[id(rec)] = {}
            for p, owner in rec.params.items():
                got.setdefault(owner, []).append(p)
        return got

    def _own_names(self, a_name: str, b_name: str | None) -> tuple[dict[str, str], str | None]:
        """B's module's own parameters (local names) -> A's module's, and a note where their
        names differ (a port's ``w``/``b`` for ``weight``/``bias``): paired by position where
        both have as many of the same shapes in the same order, else only those of the same
        name (the others' gradients are not compared)."""
        key = (a_name, b_name)
        got = self._names_cache.get(key)
        if got is not None:
            return got
        ra, rb = self.ra, self.rb
        assert rb is not None

        def own(rec: RunRecord, name: str | None) -> list[str]:
            if name is None:
                return []
            return [p[len(name) + 1 :] if name else p for p in self._params_of(rec).get(name, ())]

        def shape(rec: RunRecord, name: str, local: str) -> Any:
            g = rec.param_grads.get(f"{name}.{local}" if name else local)
            if g is None and rec.modules is not None and name in rec.modules:
                g = rec.modules[name]._parameters.get(local)
            return None if g is None else tuple(g.shape)

        pa, pb = own(ra, a_name), own(rb, b_name)
        note = None
        if set(pa) == set(pb):
            pairs = {n: n for n in pb}
        elif len(pa) == len(pb) and all(
            shape(ra, a_name, x) == shape(rb, b_name or "", y) is not None for x, y in zip(pa, pb)
        ):
            pairs = dict(zip(pb, pa))
            note = "parameters paired by position (their names differ): " + ", ".join(
                f"{y} (b) with {x} (a)" for x, y in zip(pa, pb) if x != y
            )
        else:
            pairs = {n: n for n in pb if n in pa}
            left = [n for n in pa if n not in pairs.values()] + [n for n in pb if n not in pairs]
            note = (
                f"parameter gradients of {', '.join(left[:4])} not compared: A's module and B's "
                "have other parameters (names, shapes); pass a B whose module holds the same"
            )
        self._names_cache[key] = (pairs, note)
        return pairs, note

    def _run(
        self, rep: Replay, pos: int, grads: bool, r: CompareRow, check: bool = False
    ) -> Result | None:
        """``rep.run``; a failure is said in the row. ``check``: the replay of a check (of
        conditioning, against A's own module), not the row's own: its failure says the check
        could not run, and the row keeps its errors (no warning that it has none)."""
        try:
            return rep.run(pos, grads)
        except Exception as exc:  # a module that cannot run on its own: say so in the row
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if check:
                why = f"a check of its dtypes could not replay it: {msg[:160]}"
                if why not in r.note:
                    r.note = f"{r.note}; {why}" if r.note else why
                return None
            r.note = f"replay failed: {msg[:160]}"
            if r.label not in self.failed:
                self.failed.append(r.label)
            return None

    def _local(self, i: int, r: CompareRow) -> None:
        if self.rep_b is None:
            return
        ca = self.ra.calls[i]
        got = self._forced(i)
        forced = got is not None
        if got is None:
            got = self._run(self.rep_b, i, self.grads, r)
            if got is None and self.grads:
                # its backward cannot run on A's gradients (an output of another shape): its
                # forward still can, and says what differs
                why = r.note
                got = self._run(self.rep_b, i, False, r)
                if got is not None:
                    r.note = f"{why} (backward; its forward replayed alone)"
        if got is None:
            return
        if got.ran:
            r.note = "children ran for real (inputs changed structure): " + ", ".join(got.ran)
        if got.ran_in_place:
            why = (
                "children ran for real (they change an input in place and return another "
                "tensor, so A's value of that input after the call is not recorded): "
                + ", ".join(got.ran_in_place)
            )
            r.note = f"{r.note}; {why}" if r.note else why
            self.notes.append(f"{r.label}: its local error includes its {why}")
        r.local_error = worst([self.norms.rel_error(ca.output, got.output), *got.child_errors])
        if (self.mixed or id(r) in self._lows) and has_integers(ca.output):
            self._int_out[i] = got.output
        if not self.grads or got.in_grads is None or ca.in_grad is None:
            return
        lost = [c for c in ca.children if c in self.lost_in]
        if i in self.lost_seed or lost:
            # the replay's backward would miss a path A's run had: no local gradient error
            what = (
                "its output's gradient"
                if i in self.lost_seed
                else "the input gradient of "
                + ", ".join(f"{self.ra.calls[c].name}#{self.ra.calls[c].index}" for c in lost[:3])
            )
            why = (
                f"no local gradient error: A's record lacks {what} (a value changed in place "
                "after it was handed on through views of views, whose gradient PyTorch does not "
                "hand over), so B's replay would miss that path"
            )
            r.note = f"{r.note}; {why}" if r.note else why
            return
        if i in self.aux:
            used = self.ra.calls[self.aux[i]]
            why = (
                "no local gradient error: the recorded loss also used a value handed on inside "
                f"this call ({used.name}#{used.index}'s output: an auxiliary term on an "
                "activation), so A's gradients here hold more than its output gradient gives "
                "and B's replay would miss that path"
            )
            r.note = f"{r.note}; {why}" if r.note else why
            return
        errs = [
            self.norms.rel_pairs(list(zip(ca.in_grad, got.in_grads)), self.missing),
            *got.child_grad_errors,
        ]
        once = (ca.name, 1) not in self.ra.by_key
        direct = got.param_grads and all("." not in n for n in got.param_grads)
        pre = f"{ca.name}." if ca.name else ""
        if forced and got.param_grads:
            # the module's own parameter gradients over all its calls: A's whole .grad
            f = self.forced
            assert f is not None
            calls = self._calls_of(ca.name)
            self._whole[i] = (
                list(errs),
                [k for k in calls if k in f.results],
                dict(got.param_grads),
            )
            errs.append(self.norms.rel_pairs(self._against_grad(pre, got.param_grads, r)))
        elif forced:
            pass
        elif (
            got.param_grads
            and once
            and direct
            and not any(pre + n in self.shared for n in got.param_grads)
            and not self._used_outside(ca.name, got.param_grads)
        ):
            # a module called once whose own parameters no other module uses: its local
            # parameter gradients are the whole run's .grad of A (no replay of A needed)
            self._whole[i] = (list(errs), [i], dict(got.param_grads))
            errs.append(self.norms.rel_pairs(self._against_grad(pre, got.param_grads, r)))
        elif got.param_grads and self.rep_a is not None:
            ref = self._run(self.rep_a, i, True, r)
            if ref is not None and ref.param_grads is not None:
                to_a, note = self._own_names(ca.name, self.map(ca.name))
                if note is not None and note not in r.note:
                    r.note = f"{r.note}; {note}" if r.note else note
                errs.append(
                    self.norms.rel_pairs(
                        [
                            (ref.param_grads.get(to_a.get(n, n)), g)
                            for n, g in got.param_grads.items()
                            if n in to_a or "." in n
                        ]
                    )
                )
        elif got.param_grads and self._used_outside(ca.name, got.param_grads):
            why = (
                "parameter gradients not compared: the parameters are also used outside this "
                "module's calls (A's .grad holds those uses) and A is a record, not a live model "
                "whose own call could be replayed"
            )
            r.note = f"{r.note}; {why}" if r.note else why
        r.local_grad_error = worst(errs)

    def _against_grad(
        self, pre: str, grads: Mapping[str, Any], r: CompareRow
    ) -> list[tuple[Any, Any]]:
        """The pairs (A's whole ``.grad``, B's gradient) of a module's own parameters, leaving
        out those the recorded A also used outside the model's call (a loss term on them: A's
        ``.grad`` holds that use), with a note on the row."""
        out = self.ra.outside
        a_name = pre[:-1]
        to_a, note = self._own_names(a_name, self.map(a_name))
        if note is not None and note not in r.note:
            r.note = f"{r.note}; {note}" if r.note else note
        grads = {
            to_a.get(n, n): g
            for n, g in grads.items()
            if n in to_a or "." in n  # (a child's parameter: its own name)
        }
        skipped = [pre + n for n in grads if pre + n in out]
        if skipped:
            why = (
                f"gradients of {', '.join(skipped[:3])} not compared: A's record was made with a "
                "loss that also uses them outside the model (a term on the weights, e.g. weight "
                "decay), so its .grad holds that use"
            )
            if why not in r.note:
                r.note = f"{r.note}; {why}" if r.note else why
        return [
            (self.ra.param_grads.get(pre + n), g) for n, g in grads.items() if pre + n not in out
        ]

    def _used_outside(self, a_name: str, params: Mapping[str, Any]) -> bool:
        """Whether the one pass saw a gradient reach one of these parameters (local names of
        A's module ``a_name``) outside their owners' calls."""
        f, b_name = self.forced, self.map(a_name)
        if f is None or not f.used_outside or b_name is None:
            return False
        pre = f"{b_name}." if b_name else ""
        return any(pre + n in f.used_outside for n in params)

    def _calls_of(self, a_name: str) -> list[int]:
        """A's calls of module ``a_name``, in order (positions in A's record)."""
        out, k, by_key = [], 0, self.ra.by_key
        while (a_name, k) in by_key:
            out.append(by_key[(a_name, k)])
            k += 1
        return out

    def _confirm(self, r: CompareRow, whole: tuple[list[Any], list[int], dict[str, Any]]) -> None:
        """A row whose parameter gradients were compared with A's whole ``.grad``, over
        tolerance: that ``.grad`` also holds any use of the parameters outside the module's calls
        (its caller's ``h @ lin.weight``, a loss term), so the module's own gradients (B's, as the
        row has them: the one pass's sum over its calls, or its one call's replay) are compared
        again with A's replay of the same calls (summed over them)."""
        if self.rep_a is None:
            return
        others, calls, mine = whole
        ref: dict[str, torch.Tensor] = {}
        for k in calls:
            got_a = self._run(self.rep_a, k, True, r, check=True)
            if got_a is None:
                return
            for n, g in (got_a.param_grads or {}).items():
                ref[n] = ref[n] + g if n in ref else g
        to_a, _ = self._own_names(r.name, self.map(r.name))
        pairs = [(ref.get(to_a.get(n, n)), g) for n, g in mine.items() if n in to_a or "." in n]
        r.local_grad_error = _worst([value(e) for e in others] + [rel_pairs(pairs)])

    def _verdict(self, i: int, r: CompareRow) -> None:
        over = lambda e: e is not None and e > r.tol  # noqa: E731
        whole = self._whole.pop(i, None)
        if whole is not None and over(r.local_grad_error):
            self._confirm(r, whole)
        kind, explained = None, False
        low = self._lows.get(id(r), self.low)
        rounding = self._round_replay(low)
        if over(r.local_error):
            kind = "forward"
            if rounding is not None:
                kind = self._explained(i, r, kind, rounding, low)
                explained = kind is None
        if kind is None and over(r.local_grad_error):
            # also where the forward's error was explained: a backward fault is a fault (there,
            # only where a reference was computed that does not explain it)
            kind, said = "backward", r.note
            if rounding is not None:
                self._strict = not explained
                kind = self._explained(i, r, kind, rounding, low)
                self._strict = True
                if said and r.note != said:
                    r.note = f"{said}; {r.note}" if r.note else said
        if kind is None and r.compile_error is not None:
            assert self.rb is not None
            limit = tolerance(lower(self.rb.run_dtype, low), 1) + r.tol - tolerance(low, 1)
            if r.compile_error > limit:
                kind = "compiled"
                back = value(self._compiled_back.get(id(r)))
                if back is not None and back > limit:
                    why = (
                        f"its compiled backward differs from its eager backward by {back:.1e} "
                        "(B's module run eagerly on the compiled run's values)"
                    )
                    r.note = f"{r.note}; {why}" if r.note else why
        r.flagged = kind

    def _reference(self, i: int, r: CompareRow, grads: bool) -> tuple[Any, Any, bool]:
        """What a check of conditioning measures against: A's output and input gradients, or,
        for a recorded A, the stand-in's own replay on A's values (``(output, in_grads, True)``;
        ``(None, None, True)`` when it cannot run)."""
        ca = self.ra.calls[i]
        if self.rep_stand is None:
            return ca.output, ca.in_grad, False
        got = self._run(self.rep_stand, i, grads, r, check=True)
        if got is None:
            return None, None, True
        return got.output, got.in_grads, True

    def _round_replay(self, low: torch.dtype) -> Replay | None:
        """The replay of A's modules on A's values rounded to ``low`` (the conditioning check):
        the models' lower dtype's (``rep_round``), or, for a call that computed in a lower
        dtype still (a mixed-precision model), one for that dtype, made once (a live A only)."""
        if low == self.low:
            return self.rep_round
        got = self._rounds.get(low)
        if got is None and self.ra.modules is not None and self.rb is not None:
            ra = self.ra
            got = self._rounds[low] = Replay(
                ra.modules, ra, ra, lambda n: n, ra.dtype, ra.autocast, round_to=low
            )
        return got

    def _explained(
        self, i: int, r: CompareRow, kind: str, rounding: Replay, low: torch.dtype
    ) -> str | None:
        """A local error the reference shows too when its inputs are rounded to the lower dtype
        (``low``, by ``rounding``) comes from the module's conditioning (max-pooling ties,
        cancellation), not from B."""
        grads = kind == "backward"
        out, in_grad, stand = self._reference(i, r, grads)
        got = self._run(rounding, i, grads, r, check=True)
        if got is None or (stand and out is None):
            return kind
        # against a stand-in the children's values are A's, not the stand-in's: its own output
        # and input gradients only
        if not grads:
            e_round = _worst([rel_error(out, got.output), *([] if stand else got.child_errors)])
            e = r.local_error
        else:
            e_round = _worst(
                [
                    rel_pairs(list(zip(in_grad or [], got.in_grads or []))),
                    *([] if stand else got.child_grad_errors),
                ]
            )
            e = r.local_grad_error
        what = "gradient" if grads else "output"
        if not grads and e == math.inf and i in self._int_out:
            # integer outputs differ: only the dtype check (A's module in B's dtype, whose
            # integers a fault-free B reproduces exactly) can explain that
            return self._explained_by_dtype(i, r, kind, what, low)
        # (a non-finite error is never explained: inf > inf would read as explained)
        if e_round is None or e is None or not math.isfinite(e) or e > 2 * e_round + r.tol:
            return self._explained_by_dtype(i, r, kind, what, low)
        whose = "a copy of B in A's dtype (A is a record)" if stand else "A's own"
        r.note = (
            f"{what} not stable across dtypes here: rounding its inputs to {str(low)[6:]} "
            f"moves {whose} {what} by {e_round:.1e} (e.g. max-pooling ties, cancellation), so "
            f"its local error {e:.1e} is not a fault"
        )
        return None

    def _explained_by_dtype(
        self, i: int, r: CompareRow, kind: str, what: str, dtype: torch.dtype
    ) -> str | None:
        """A local error that A's own module shows too when it computes in B's dtype (a copy of
        A in that dtype, or under B's autocast, replayed on A's values the same way) comes from
        the dtype (an ill-conditioned computation: batch norm over two values, cancellation),
        not from B's code. For a recorded A, B's copy in A's dtype stands in for A: B's own
        module (in B's dtype) against that copy, both on A's values."""
        if self.rep_stand is not None and self.rep_b is not None:
            return self._explained_by_stand_in(i, r, kind, what)
        low = self._low_replay(dtype)
        if low is None:
            return kind
        ca = self.ra.calls[i]
        got = self._run(low, i, kind == "backward", r, check=True)
        if got is None:
            return kind
        if kind == "forward":
            e_low = _worst([rel_error(ca.output, got.output), *got.child_errors])
            e, e_low = self._floats(i, r.local_error, e_low, ca.output, got.output, exact=True)
        else:
            errs = [
                rel_pairs(list(zip(ca.in_grad or [], got.in_grads or []))),
                *got.child_grad_errors,
            ]
            pre = f"{ca.name}." if ca.name else ""
            once = (ca.name, 1) not in self.ra.by_key
            if (
                got.param_grads
                and once
                and not any(pre + n in self.shared for n in got.param_grads)
            ):
                errs.append(rel_pairs(self._against_grad(pre, got.param_grads, r)))
            e_low, e = _worst(errs), r.local_grad_error
        return self._ill_conditioned(r, kind, what, e_low, e, None)

    def _floats(
        self, i: int, e: Any, e_ref: Any, ref: Any, ref_got: Any, exact: bool = False
    ) -> tuple[Any, Any]:
        """B's local error and the reference's, or, where both are infinite because integer
        outputs differ in both (a router's expert indices, flipped by rounding in B's dtype as in
        the reference's), the errors of their floating outputs: a fault in what the module
        computes in floating point still shows there (it was hidden: inf against inf).
        ``exact``: the reference computes as B does (A's module in B's dtype, on the same
        values), so B's integer outputs must be the reference's exactly (a fault only in the
        indices shows there), else B's error stays infinite."""
        if e != math.inf or e_ref != math.inf or i not in self._int_out:
            return e, e_ref
        if exact and not _same_integers(self._int_out[i], ref_got):
            return e, 0.0
        e_f = float_error(self.ra.calls[i].output, self._int_out[i])
        ref_f = float_error(ref, ref_got)
        if e_f is None or ref_f is None:
            # no floating output to decide: integers the reference computing as B does gives
            # exactly (checked above) are the dtype's, not B's module's
            return (0.0, 0.0) if exact else (e, e_ref)
        return e_f, ref_f

    def _ill_conditioned(
        self, r: CompareRow, kind: str, what: str, e_low: Any, e: Any, stand: str | None
    ) -> str | None:
        """``kind`` unless the reference in B's dtype (A's own module, or ``stand``: what stands
        in for it) is off by about as much as B's module (then ``None``, and the row says so)."""
        if e_low is None and e is not None and not self._strict:
            r.note = (
                f"{what} error {e:.1e} not judged: its forward's error is explained by the "
                "dtypes and no reference for its gradient could be computed"
            )
            return None
        if e_low is None or e is None or not math.isfinite(e) or e > 2 * e_low + r.tol:
            return kind
        dtype = str(self.rb.autocast or self.rb.dtype)[6:] if self.rb is not None else "?"
        whose = (
            stand or f"A's own module computing in {dtype} on A's values is off by {e_low:.1e} too"
        )
        r.note = (
            f"{what} ill-conditioned in {dtype}: {whose} (e.g. batch norm over very few values, "
            f"cancellation; or a code path the module takes in {dtype}, which A's code takes "
            f"too), so its local error {e:.1e} is not a change in B's module"
        )
        return None

    def _explained_by_stand_in(self, i: int, r: CompareRow, kind: str, what: str) -> str | None:
        assert self.rep_b is not None
        grads = kind == "backward"
        assert self.rep_stand is not None
        ref = self._run(self.rep_stand, i, grads, r, check=True)
        got = self._run(self.rep_b, i, grads, r, check=True)
        if got is None or ref is None or ref.output is None:
            return kind
        out = ref.output
        if not grads:
            e, e_low = self._floats(i, r.local_error, rel_error(out, got.output), out, got.output)
        else:
            errs = [rel_pairs(list(zip(ref.in_grads or [], got.in_grads or [])))]
            if got.param_grads and ref.param_grads:  # B's own parameters: the copy's too
                errs.append(
                    rel_pairs([(ref.param_grads.get(n), g) for n, g in got.param_grads.items()])
                )
            e_low = _worst(errs)
            e = r.local_grad_error
            if not self._strict and got.child_grad_errors:
                e_low = None  # its children's gradients have no reference here: not judged
        stand = (
            f"B's module is off by {e_low:.1e} from a copy of itself in A's dtype, both on A's "
            "values (A is a record)"
            if e_low is not None
            else None
        )
        return self._ill_conditioned(r, kind, what, e_low, e, stand)

    def _low_replay(self, dtype: torch.dtype) -> Replay | None:
        """A's modules computing in B's dtype (each copied when first replayed, :class:`CopiesIn`;
        or A's own under B's autocast), made once; for a call that computed in a lower dtype
        than B's model (``dtype``: a mixed-precision B), A's modules copied in that dtype."""
        if self.ra.modules is None or self.rb is None:
            return None
        ra, rb = self.ra, self.rb
        key = None if dtype in (self.low, rb.run_dtype) else dtype  # None: B's own dtype
        made = self._low_replays.get(key)
        if made is not None:
            return made
        if key is None and rb.autocast is not None:  # A's own modules under B's autocast
            made = Replay(ra.modules, ra, rb, lambda n: n, ra.dtype, rb.autocast)
        elif ra.modules.get("") is not None:
            d = rb.dtype if key is None else key
            made = Replay(CopiesIn(ra.modules, d), ra, rb, lambda n: n, d, None)
        if made is not None:
            self._low_replays[key] = made
        return made


_ERRORS = (
    "error",
    "local_error",
    "compile_error",
    "grad_error",
    "local_grad_error",
    "param_grad_error",
)


def _same_integers(x: Any, y: Any) -> bool:
    """Whether the integer tensors of two values (same structure) are equal."""
    a = [t for t in tensors_of(x) if not continuous(t)]
    b = [t for t in tensors_of(y) if not continuous(t)]
    return (
        len(a) == len(b)
        and all(p.shape == q.shape and torch.equal(p, q.to(p.device)) for p, q in zip(a, b))
        and int_numbers(x) == int_numbers(y)  # (Python ints and bools too)
    )


def _own_params(module: nn.Module) -> list[str]:
    """``[n for n, p in module.named_parameters(recurse=False) if p.requires_grad]``, without
    the generator machinery (once per row): a parameter held under two names counts under its
    first, as ``named_parameters`` gives it."""
    out: list[str] = []
    seen: set[int] = set()
    for n, p in module._parameters.items():
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            out.append(n)
    return out


def _shared_params(ra: RunRecord, b: nn.Module | None) -> set[str]:
    """Names of parameters that several modules hold (tied weights), in A (live) or B."""
    model = ra.modules.get("") if ra.modules is not None else b
    if model is None:
        return set()
    owners: dict[int, int] = {}
    for _, m in named_modules(model):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    shared = set()
    for mname, m in named_modules(model):
        for pname, p in m.named_parameters(recurse=False):
            if owners[id(p)] > 1:
                shared.add(f"{mname}.{pname}" if mname else pname)
    return shared


def _worst(errors: list[float | None]) -> float | None:
    known = [e for e in errors if e is not None]
    return max(known) if known else None


def _lost_calls(rec: RunRecord | None, kind: str = "") -> set[int]:
    """The positions of the calls with a gradient the run lost (``grad<k>_<i>`` and
    ``ingrad<k>_<i>`` keys of :attr:`RunRecord.lost`; ``kind``: only those of that prefix)."""
    if rec is None:
        return set()
    out = set()
    for key in rec.lost:
        if kind and not (key.startswith(kind) and key[len(kind) : len(kind) + 1].isdigit()):
            continue
        digits = key.removeprefix("in").removeprefix("grad").split("_")[0]
        if digits.isdigit():
            out.add(int(digits))
    return out


def _depth(rec: RunRecord, pos: int) -> int:
    d, p = 0, rec.calls[pos].parent
    while p is not None:
        d, p = d + 1, rec.calls[p].parent
    return d


def _other_structure(a: Any, b: Any) -> str | None:
    """Why two outputs of one call cannot be compared tensor by tensor (their error is
    ``inf``), where the tensors of one sit where the other has none: which paths, what the
    other has there, and the error of the tensors both have (an attention returning its weights
    in one run and ``None`` in the other: eager against SDPA attention)."""
    pa = dict(iter_tensors(a))
    pb = dict(iter_tensors(b))
    only_a = [p for p in pa if p not in pb]
    only_b = [p for p in pb if p not in pa]
    if not only_a and not only_b:
        return None

    def where(paths: list[Any], other: Any) -> str:
        shown = []
        for p in paths[:3]:
            there = at_path(other, p)
            what = "None" if there is None else type(there).__name__
            shown.append(f"[{']['.join(map(str, p))}] ({what} in the other)")
        return ", ".join(shown) + (" ..." if len(paths) > 3 else "")

    parts = []
    if only_a:
        parts.append(f"a returns tensors at {where(only_a, b)}")
    if only_b:
        parts.append(f"b returns tensors at {where(only_b, a)}")
    common = [(pa[p], pb[p]) for p in pa if p in pb]
    err = rel_pairs(common) if common else None
    both = f"; the tensors both return differ by {err:.1e}" if err is not None else ""
    return (
        f"its outputs differ in structure ({'; '.join(parts)}), so its errors are inf{both} "
        "(an optional output one run gives and the other does not, such as attention weights "
        "from eager attention and not from SDPA: make both return the same)"
    )


def _ancestors(rec: RunRecord, i: int) -> list[int]:
    """The calls enclosing A's call ``i``, innermost first."""
    out = []
    p = rec.calls[i].parent
    while p is not None:
        out.append(p)
        p = rec.calls[p].parent
    return out


def _verdicts(rec: RunRecord, rows: list[tuple[int, CompareRow]]) -> tuple[list[str], str | None]:
    flagged = {i for i, r in rows if r.flagged}
    ancestors = {p for i in flagged for p in _ancestors(rec, i)}
    culprits = sorted(((r.end, r.label) for i, r in rows if i in flagged and i not in ancestors))
    divergent = sorted((r.end, r.label) for _, r in rows if r.error is not None and r.error > r.tol)
    return [c for _, c in culprits], divergent[0][1] if divergent else None


def build_report(job: _Job) -> CompareReport:
    """Rows, verdicts and notes of a comparison whose records are made."""
    ra, rb = job.ra, job.rb
    assert rb is not None
    matched, unmatched = job.pairs()
    job.force()
    job.phase()
    pending = [(i, j, job.row(i, j)) for i, j in matched]
    job.norms.resolve()
    rows = [(i, job.finish(i, j, r)) for i, j, r in pending]
    culprits, divergent = _verdicts(ra, rows)
    by_label = {r.label: r for _, r in rows}
    culprit = by_label[culprits[0]].name if culprits else None
    notes = [
        f"{side}: the records of {r.world} ranks, joined into one run on the combined batch"
        for side, r in (("a", ra), ("b", rb))
        if r.world > 1
    ]
    for side, rec in (("a", ra), ("b", rb)):
        if rec.lost:
            layers = sorted(set(rec.lost.values()))
            notes.append(
                f"{side}: no gradient recorded for {len(rec.lost)} value(s) of "
                f"{', '.join(layers[:4])}{' ...' if len(layers) > 4 else ''}: changed in place "
                "(nn.ReLU(inplace=True), out += x) after they were handed on, and PyTorch drops "
                "a gradient hook on a view changed in place; those gradients compare only where "
                "both runs have one (use inplace=False to compare them)"
            )
    threads = [(side, r.elsewhere) for side, r in (("a", ra), ("b", rb)) if r.elsewhere]
    if len(threads) == 2 and threads[0][1].keys() == threads[1][1].keys():
        threads = [("a and b", threads[0][1])]
    for side, elsewhere in threads:
        names = sorted(elsewhere)
        why = (
            f"{side}: {', '.join(map(repr, names[:4]))}{' ...' if len(names) > 4 else ''} ran in "
            f"another thread ({', '.join(sorted(set(elsewhere.values()))[:2])}) than the one "
            "running the model: hooks act on their own thread, so those calls have no rows of "
            "their own and count as their caller's own computation; call them in the model's "
            "thread for rows of their own"
        )
        notes.append(why)
        warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)
    if (ra.partial_grads and not ra.lost) or (rb.partial_grads and not rb.lost):
        notes.append(
            "a record of the earlier format (one file per value) has no gradient where an "
            "in-place op followed a module (nn.ReLU(inplace=True), out += x): there, gradients "
            "are compared only where both runs have one; record again for every gradient"
        )
    if job.rep_b is None:
        notes.append(
            "no culprit verdict: B is a record, not a live model; the culprit needs B's modules "
            "to replay A's inputs (pass the live model as b)"
        )
    lowered: dict[torch.dtype, list[str]] = {}
    for _, r in rows:
        d = job._lows.get(id(r))
        if d is not None:
            lowered.setdefault(d, []).append(r.label)
    for d, labels in lowered.items():
        notes.append(
            f"{some_names(labels)} computed in {str(d)[6:]} (their parameters, inputs or "
            f"outputs), below the models' {str(job.low)[6:]}: their tolerances are "
            f"{str(d)[6:]}'s (a mixed-precision model)"
        )
    # a difference inside such an object that a culprit within the call explains (a cache its
    # attention modules fill) is said on its row only
    inside = {p for i, r in rows if r.flagged for p in _ancestors(ra, i)}
    unexplained = [label for i, label in job.hidden_calls if i not in inside]
    if unexplained:
        why = (
            f"{some_names(unexplained)} return tensors inside objects (not tuples, lists, "
            "dicts or dataclasses) that differ between the runs beyond their tolerance: the "
            "replays cannot hand those on, so no local error covers them and the culprit may be "
            "among these modules unnamed; return them in a tuple, dict or dataclass (or "
            "compare the module that fills the object)"
        )
        notes.append(why)
        warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)
    notes.extend(job.notes)
    per_rank = [r.name for _, r in rows if r.note and "each rank normalised its share" in r.note]
    if per_rank:
        notes.append(
            f"{some_names(per_rank)}: BatchNorm in training mode on several ranks normalises each "
            "rank's share by its own statistics; one process on the combined batch does not, so "
            "these differ by construction (see their rows): use SyncBatchNorm, or record in eval "
            "mode"
        )
    paired = {ra.calls[i].name for i, _ in matched}
    if unmatched and paired <= {""} and (len(ra.calls) > 1 or len(rb.calls) > 1):
        names_a = sorted({c.name for c in ra.calls if c.name})
        names_b = sorted({c.name for c in rb.calls if c.name})
        why = (
            f"no module of a ({ra.model or 'a'}: {some_names(names_a)}) pairs with one of b "
            f"({rb.model or 'b'}: {some_names(names_b)}), only the models themselves: they look "
            "like two different models, and the verdict can only name the whole model; compare "
            "runs of the same model, or pass names= to pair a port's modules"
        )
        notes.append(why)
        warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)
    if unmatched:
        notes.append(
            f"{len(unmatched)} call(s) ran in one run only, or were not recorded in one (see "
            "unmatched; a record made with layers=): they are not compared, so the culprit is "
            "looked for among the paired calls only"
        )
    if job.failed:
        warnings.warn(
            f"hs.compare: could not replay {len(job.failed)} module call(s) on A's inputs "
            f"({', '.join(job.failed[:3])}); their rows have no local error (see row.note)",
            HookscopeWarning,
            stacklevel=3,
        )
    loss = (ra.loss, rb.loss) if ra.loss is not None and rb.loss is not None else None
    return CompareReport(
        rows=[r for _, r in rows],
        culprit=culprit if job.rep_b is not None else None,
        culprits=culprits if job.rep_b is not None else [],
        first_divergent=divergent,
        unmatched=unmatched,
        dtypes=(str(ra.run_dtype)[6:], str(rb.run_dtype)[6:]),
        loss=loss,
        notes=notes,
    )


def compare(
    a: Any,
    b: Any,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    names: Names = None,
    autocast: torch.dtype | None = None,
    max_bytes: int | None = None,
    loss_reduction: str | None = None,
    **kwargs: Any,
) -> CompareReport:
    """Compare two runs module by module and name the module that makes the difference.

    ``a`` and ``b`` are live models or folders written by :func:`hookscope.record`; they compute
    the same function with the same module names (a model and
    ``torch.compile`` of a copy, a bf16 copy, a copy with a change, a port with ``names=``).
    Both run once on ``inputs`` (floating inputs cast to each model's parameter dtype, those a
    cache object passed in holds too; ``kwargs``
    go to both forwards), every module call recorded with its inputs and output and, with
    ``loss_fn``, after ``loss_fn(output).backward()``, its gradients. Then each module call of B
    is **replayed on A's own inputs to it**, the modules it calls returning A's outputs (so the
    replay measures the module's own code; all calls are replayed in one forward and one
    backward of B, see the guide): its output against A's is the module's *local* error; with
    ``loss_fn``, its vector-Jacobian product at A's inputs with A's output gradient against A's
    input gradient (and the module's own parameter gradients, on its first call's row) is its
    local gradient error. A compiled B also
    runs each module eagerly on the inputs its compiled run gave it: what compilation adds
    inside the module (``compile_error``).

    Tolerances come from the two dtypes: ``4 * eps(d) + 16 * eps(float32) * sqrt(K)`` with ``d``
    the less precise compute dtype of the two runs (autocast included) and ``K`` the module's
    largest reduction (the last dimension of its inputs, the fan-in of its parameters): 1.6e-5
    for fp32 pairs and 3.1e-2 for bf16 pairs at ``K = 64``. An error that the reference shows too
    when its own inputs are rounded to the lower dtype (max-pooling ties, cancellation), or when
    A's own module computes in B's dtype (a batch norm over two values), is not flagged; the
    row's ``note`` says so.

    Verdicts: ``culprit`` is the deepest module whose own computation (forward, backward, or
    what compilation adds) exceeds its tolerance; ``first_divergent`` the first module, in the
    order outputs are produced, whose output differs beyond it (where the error shows).

    A record made on several ranks of a ``torch.distributed`` run is one run on the combined
    batch: per module call, each tensor whose first dimension equals the rank's batch share is
    concatenated in rank order, any other must be equal on every rank (else the row's ``note``
    says it cannot be joined, and the row has no errors); activation gradients are rescaled
    for ``loss_reduction``, parameter gradients are the ranks' averaged ones. Give ``b`` the
    combined batch (the ranks' inputs concatenated in rank order).

    A model wrapped in ``DistributedDataParallel`` or ``nn.DataParallel`` is compared as the
    model it wraps (its names without the ``module.`` prefix, as :func:`hookscope.record` writes
    them).

    Module calls are matched by name and occurrence; calls that ran in only one model (or a
    different number of times on different ranks) are listed in ``unmatched``. Both models are left as found (``.grad``, buffers, train/eval mode); a model
    that draws random numbers (dropout in training mode) raises :class:`CompareError`.

    Args:
        a: the reference model.
        b: the model under test (same module names, or ``names=``).
        *inputs: positional inputs of both forwards.
        loss_fn: ``loss_fn(output) -> scalar tensor``; with it, gradients are compared too.
            Against a record, the output gradient it gives at the recorded output must be the
            recorded one (else :class:`CompareError`: the record was made with another loss).
        names: B's name for each of A's modules: a dict (names not in it are kept; each key a
            module of A, each value one of B) or a function (``None``: no counterpart; a name
            other than A's own must be a module of B).
        autocast: run B (and its replays) under ``torch.autocast`` with this dtype.
        max_bytes: keep at most this many bytes of each run's recorded values in memory (during
            the run too); the rest is appended to a temporary file as it comes (read back when
            compared). ``None``: no bound.
        loss_reduction: for a record made on several ranks (each its share of the batch), how
            each rank's loss reduced its share: ``"mean"`` (each rank's activation gradients are
            ``world`` times the combined run's) or ``"sum"``; checked against B's gradients.
        **kwargs: keyword inputs of both forwards.

    Example:
        >>> import copy, torch, torch.nn as nn, hookscope as hs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8))
        >>> b = copy.deepcopy(a)
        >>> b[3].eps = 0.5  # a wrong epsilon in the norm
        >>> report = hs.compare(a, b, torch.randn(4, 8), loss_fn=lambda o: o.pow(2).sum())
        >>> report.culprit, report.row("0").local_error, report.row("2").local_error
        ('3', 0.0, 0.0)
        >>> hs.compare(a, copy.deepcopy(a), torch.randn(4, 8)).culprit is None
        True
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        # a model wrapped in DistributedDataParallel or nn.DataParallel is its .module (the eager
        # names, as hs.record writes them; the wrapper's own forward splits or syncs, it computes
        # nothing): its "module." names would pair with none of the other model's
        a, b = unwrapped(a), unwrapped(b)
        with _YoungCollections() as collections:
            # each run gets inputs of its own: a forward that changes what it is given (a cache it
            # grows, a tensor it works on in place) changes neither the other run's nor the caller's
            ia, ka = _own_inputs(inputs, kwargs)
            ib, kb = _own_inputs(inputs, kwargs)
            sa = RunSpec(a, ia, ka, loss_fn, None, "a", max_bytes)
            # B's replays read A's inputs: of B's own, only their dtypes are kept
            sb = RunSpec(b, ib, kb, loss_fn, autocast, "b", max_bytes, inputs=False)
            given = dataclasses.replace(
                sb, args=inputs, kwargs=kwargs
            )  # the caller's own, to check
            check_arguments(a, b, given, names, loss_reduction)
            quantized = [
                why
                for m, what in ((a, "a"), (b, "b"))
                if isinstance(m, nn.Module)
                and (why := check_quantized(m, what, loss_fn is not None)) is not None
            ]
            reduction = loss_reduction or "mean"
            ra = _side(a, "a", sa, reduction)
            collections.phase()
            rb = _side(b, "b", sb, reduction)
            collections.phase()
            _check_records(ra, rb, given)
            quantized += [
                why
                for rec, what in ((ra, "a"), (rb, "b"))
                if rec.modules is None and (why := check_quantized(rec, what, False)) is not None
            ]
            _check_moved(ra, b, _name_map(names))
            if isinstance(a, nn.Module):
                _check_moved(rb, a, lambda n: n)
            _check_reduction(ra, rb, reduction)
            if loss_fn is not None:
                live = a if isinstance(a, nn.Module) else b if isinstance(b, nn.Module) else None
                device = _device(live) if live is not None else torch.device("cpu")
                for rec, what in ((ra, "a"), (rb, "b")):
                    if rec.modules is None:
                        check_loss(rec, what, loss_fn, device)
            check_names(names, ra, rb)
            if (ra.world > 1) != (rb.world > 1):
                # a record of several ranks: its leaves both split-shaped and equal on every
                # rank are decided by the other run's shapes (a (T, T) mask, T the share)
                to_b = _name_map(names)
                shapes_from(ra, rb, to_b)
                back = {to_b(c.name): c.name for c in ra.calls}
                shapes_from(rb, ra, lambda n: back.get(n, n))
            check_modes(ra, rb, names)
            if isinstance(a, nn.Module) and isinstance(b, nn.Module):
                check_kinds(a, b, _name_map(names))
            unchecked = []  # (a compiled run whose skipped hooks could not be checked)
            if isinstance(b, nn.Module):
                unchecked.append(
                    check_hooks_ran(ra, rb, b, inputs, kwargs, autocast, _name_map(names), "b")
                )
            if isinstance(a, nn.Module):  # (B's names back to A's)
                to_b = _name_map(names)
                table = {to_b(n): n for n in ra.modules or {}}
                unchecked.append(
                    check_hooks_ran(rb, ra, a, inputs, kwargs, None, lambda n: table.get(n, n), "a")
                )
            if (
                isinstance(a, (str, os.PathLike))
                and isinstance(b, (str, os.PathLike))
                and os.path.realpath(a) == os.path.realpath(b)
            ):
                warnings.warn(
                    f"hs.compare: a and b are the same record ({os.fspath(a)!r}): every error is 0 by "
                    "construction; give the record of the other run as b",
                    HookscopeWarning,
                    stacklevel=2,
                )
            job = _Job(ra, rb, b if isinstance(b, nn.Module) else None, names)
            job.phase = collections.phase
            job.notes.extend(quantized)
            job.notes.extend(why for why in unchecked if why is not None)
            with contextlib.ExitStack() as stack:
                for m in (a, b):
                    if isinstance(m, nn.Module):
                        stack.enter_context(preserved(m))
                report = build_report(job)
                for m, rec, other, what, cast in (
                    (a, ra, rb, "a", None),
                    (b, rb, ra, "b", autocast),
                ):
                    if isinstance(m, nn.Module) and rec.compiled:
                        _check_unhooked(report, m, (rec, other), what, cast, inputs, kwargs)
                return report


def _check_unhooked(
    report: CompareReport,
    model: nn.Module,
    recs: tuple[RunRecord, RunRecord],
    what: str,
    autocast: torch.dtype | None,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """A compiled model's run as compare records it has a hook at every module, which breaks its
    graph at each module boundary: code that compilation fuses across modules runs unfused
    there, so a difference made only there (a fusion's rounding or a compiler bug across a
    Linear and its activation) is in no row, and the report would read as if the compiled model
    were right. The model runs once more as compiled, without hooks, on the same inputs: an
    output that differs beyond the root row's tolerance both from the recorded one and from the
    other run's (what the user's compiled model computes disagrees with the reference, and the
    rows do not show it: fused rounding within the tolerance says nothing) is said, a warning
    and a note with the error; the rows stay those of the recorded run. ``recs``: this side's
    record and the other's."""
    rec, other = recs
    own_args, own_kwargs = _own_inputs(inputs, kwargs)
    dtype, device = model_dtype(model), _device(model)
    args = cast_like(own_args, dtype, device, objects=True)
    kw = cast_like(own_kwargs, dtype, device, objects=True)
    try:
        with _autocast(device, autocast):
            out = model(*args, **kw)
    except Exception as exc:
        report.notes.append(
            f"{what}: the compiled model could not be run without hooks to check that the "
            f"recorded run (a hook at every module) computes what it computes "
            f"({type(exc).__name__}: {exc}); a difference fused across modules would not show"
        )
        return
    err = rel_error(rec.output, out)
    root = next((r for r in report.rows if r.name == "" and r.index == 0), None)
    tol = root.tol if root is not None and root.tol is not None else tolerance(rec.run_dtype, 1)
    if err is None or err <= tol:
        return
    if other.output is not None:
        ref = rel_error(other.output, out)
        if ref is not None and ref <= tol:
            return  # (the compiled model agrees with the other run: nothing hidden)
    why = (
        f"{what}: the compiled model without hooks gives another output than its recorded run "
        f"(relative error {err:.3g}, tolerance {tol:.3g}): the recorded run has a hook at every "
        "module, which breaks the compiled graph at each module boundary, so code compiled "
        "across module boundaries (fused) ran unfused there; the difference is made in such "
        "code and no row shows it. Compare coarser: record each run with hs.record(model, "
        "folder, layers=[...]) on a few large blocks (fewer breaks) and compare the records, "
        "or compile the blocks one by one (block.compile()) to find the fusion"
    )
    report.notes.append(why)
    warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)


def _nothing() -> None:
    return None


class _YoungCollections:
    """Python's automatic garbage collection paused while ``hs.compare`` runs, the young
    generation collected at the end of each run (:meth:`phase`) and collection resumed on exit.

    A comparison keeps thousands of small objects (its records, rows, lazy errors) for its
    whole length: automatic collection promotes them to the oldest generation, and the full
    collections that follow (the whole process's objects: 0.2 s each with Transformers
    imported, once every 20 comparisons of the fault suite's Llama) cost more than the
    comparison's own work. Collecting the young generation at each run's end still frees the
    reference cycles a run leaves (a Transformers cache of its forward, 3 MB per run of the
    benchmark's GPT-2) as soon as the run ends. Where collection was disabled by the caller,
    nothing is changed."""

    def __enter__(self) -> _YoungCollections:
        self.paused = gc.isenabled()
        if self.paused:
            gc.disable()
        return self

    def phase(self) -> None:
        if self.paused:
            gc.collect(0)

    def __exit__(self, *exc: Any) -> None:
        if self.paused:
            gc.enable()


def _own_inputs(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A copy of the inputs for one run: tensors cloned (keeping ``requires_grad``), the objects
    around them (a cache) deep-copied. Inputs that cannot be copied are refused by name: a run
    that changed them would hand the other run changed inputs, silently."""
    memo: dict[int, Any] = {}
    for t in tensors_of((inputs, kwargs)):
        c = t.detach().clone()
        if t.requires_grad:
            c.requires_grad_(True)
        memo[id(t)] = c
    try:
        return copy.deepcopy((tuple(inputs), dict(kwargs)), memo)
    except Exception as exc:
        raise CompareError(
            "hs.compare: cannot copy the inputs for each run "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); each "
            "run needs its own, so that a forward changing what it is given (a cache it grows) "
            "does not change the other run's: pass inputs copy.deepcopy can copy"
        ) from None


def _side(m: Any, what: str, spec: RunSpec, loss_reduction: str) -> RunRecord:
    if isinstance(m, nn.Module):
        return record_run(spec)
    if isinstance(m, (str, os.PathLike)):
        return load_record(m, loss_reduction)
    raise TypeError(
        f"hs.compare: {what} must be an nn.Module or a folder written by hs.record, "
        f"got {type(m).__name__}"
    )


def _check_moved(rec: RunRecord, live: Any, to_live: Callable[[str], str | None]) -> None:
    """A record whose block changed parameters after the model's call (an optimizer step) is
    refused against a live model that holds those new values: it is the model after the step,
    not the one the record ran (every layer would differ, the first named)."""
    if not rec.moved or not isinstance(live, nn.Module):
        return
    params = dict(named_parameters(live))
    same = []
    for name, crc in rec.moved.items():
        mod, _, local = name.rpartition(".")
        theirs = to_live(mod) if mod else to_live("")
        p = params.get(f"{theirs}.{local}" if theirs else local) if theirs is not None else None
        if p is None:
            return  # (another model: compared as it is)
        now = weights_crc(p)
        # or a copy in another dtype holding the stepped values cast to it (a bf16 copy of the
        # stepped model; the checksum covers the dtype, so the recorded one's matches no other)
        if now is None or (
            now != crc
            and now != rec.moved_cast.get(name, {}).get(str(p.dtype).removeprefix("torch."))
        ):
            return  # (a copy from before the step, or another model: compared as it is)
        same.append(name)
    raise CompareError(
        f"hs.compare: the record was made with parameters changed inside its with block after "
        f"the model's call ({some_names(same)}: an optimizer step), and the live model holds "
        "those new values: it is the model after the step, not the one the record ran; give a "
        "copy made before the step (copy.deepcopy before optimizer.step()), or record with the "
        "step after the with block"
    )


def _check_records(ra: RunRecord, rb: RunRecord, spec: RunSpec) -> None:
    """Each recorded side must hold the inputs given (when a live side runs on them, or they
    are given)."""
    live = ra.modules is not None or rb.modules is not None
    for rec in (ra, rb):
        if rec.modules is None and (live or spec.args or spec.kwargs):
            _check_inputs(rec, spec.args, spec.kwargs)
    if not live and not spec.args and not spec.kwargs:
        _check_same_inputs(ra, rb)


def _check_same_inputs(ra: RunRecord, rb: RunRecord) -> None:
    """Two records compared with each other must have run on the same inputs (each cast to its
    model's dtype: compared in the less precise of the two): refuse others by name."""
    pa, pb = ra.by_key.get(("", 0)), rb.by_key.get(("", 0))
    if pa is None or pb is None:
        warnings.warn(
            "hs.compare: a record holds no call of the model itself (recorded with layers= that "
            "leave it out), so the two records' inputs cannot be checked against each other: "
            "record with layers including '' (the model) to have them checked",
            HookscopeWarning,
            stacklevel=4,
        )
        return
    low = lower(ra.dtype, rb.dtype)
    cpu = torch.device("cpu")
    xa = cast_like(ra.calls[pa].inputs, low, cpu, objects=True)
    xb = cast_like(rb.calls[pb].inputs, low, cpu, objects=True)
    other, xb = _aligned(xa, xb)
    err = rel_error(xa, xb) if other is None else None
    if other is None and (err is None or err == 0.0):
        return
    raise CompareError(
        "hs.compare: the two records were made on different inputs"
        + (f": {other}" if other is not None else f" (relative difference {err:.2e})")
        + "; compare records of runs on the same inputs (the same batch, in the same order)"
    )


def _check_reduction(ra: RunRecord, rb: RunRecord, loss_reduction: str) -> None:
    """A record of several ranks rescaled with the wrong ``loss_reduction`` has root output
    gradients ``world`` times (or ``1/world`` times) the other run's: refuse it by name."""
    world = max(ra.world, rb.world)
    if ra.world == rb.world or not (ra.has_grads and rb.has_grads):
        return
    pa, pb = ra.by_key.get(("", 0)), rb.by_key.get(("", 0))
    if pa is None or pb is None:
        return
    ga, gb = ra.calls[pa].grad, rb.calls[pb].grad
    na = sum(float(g.double().norm()) ** 2 for g in ga or [] if g is not None) ** 0.5
    nb = sum(float(g.double().norm()) ** 2 for g in gb or [] if g is not None) ** 0.5
    if na == 0.0 or nb == 0.0:
        return
    ratio = na / nb if ra.world > 1 else nb / na  # the joined ranks' against one process's
    # the other reduction scales them by world (given "sum" for a mean) or 1/world (given "mean"
    # for a sum); any other ratio far from 1 is another loss
    other = "mean" if loss_reduction == "sum" else "sum"
    expected = math.log(world) if loss_reduction == "sum" else -math.log(world)
    if abs(math.log(ratio) - expected) >= math.log(world) / 2:
        if abs(math.log(ratio)) < math.log(world) / 2:
            return
        raise CompareError(
            f"hs.compare: the {world} ranks' output gradients are {ratio:.3g} times the "
            f"one-process run's, with loss_reduction={loss_reduction!r} (the other reduction "
            f"would make that {ratio * (world if loss_reduction == 'mean' else 1 / world):.3g}): "
            "the two runs' losses differ, not only in how the ranks reduce theirs; compare runs "
            "of the same loss"
        )
    raise CompareError(
        f"hs.compare: with loss_reduction={loss_reduction!r} the {world} ranks' output gradients "
        f"are {ratio:.3g} times the one-process run's: the ranks' loss looks like a {other}; "
        f"pass loss_reduction={other!r}"
    )


_ATOMS = tuple(SCALARS)


def _where(path: str) -> str:
    return path or "the inputs"


def _difference(rec: Any, given: Any, path: str, depth: int = 10) -> str | None:
    """Where the recorded inputs and the given ones differ other than in their tensors' values
    (those :func:`rel_error` compares): structure, numbers, flags, strings, and the objects
    inside them (a cache object: its attributes, its tensors' shapes), or ``None``."""
    if isinstance(rec, torch.Tensor) or isinstance(given, torch.Tensor):
        if not (isinstance(rec, torch.Tensor) and isinstance(given, torch.Tensor)):
            return f"{_where(path)} is a {type(given).__name__} here, a {type(rec).__name__} in the record"
        if rec.shape != given.shape:
            return (
                f"{_where(path)} has shape {tuple(given.shape)} here, {tuple(rec.shape)} in the "
                "record"
            )
        if rec.dtype != given.dtype and not (rec.is_floating_point() and given.is_floating_point()):
            # (floating ones are cast to each model's dtype: any float dtype is the same input)
            return (
                f"{_where(path)} is {str(given.dtype)[6:]} here, {str(rec.dtype)[6:]} in the record"
            )
        if "__dict__" in path and not torch.equal(rec, given.to(rec.device, rec.dtype)):
            # inside an object (a cache) rel_error does not walk: its values compared here
            return f"{_where(path)} holds other values here than in the record"
        return None
    if isinstance(rec, _ATOMS) or isinstance(given, _ATOMS):
        same = type(rec) is type(given) and (
            rec == given or (isinstance(rec, float) and math.isnan(rec) and math.isnan(given))
        )
        return None if same else f"{_where(path)} is {given!r} here, {rec!r} in the record"
    if type(rec).__name__ != type(given).__name__:
        return (
            f"{_where(path)} is a {type(given).__name__} here, a {type(rec).__name__} in the record"
        )
    if depth == 0:
        return None
    if isinstance(rec, (list, tuple)):
        if len(rec) != len(given):
            return f"{_where(path)} has {len(given)} items here, {len(rec)} in the record"
        for k, (x, y) in enumerate(zip(rec, given)):
            got = _difference(x, y, f"{path}[{k}]", depth - 1)
            if got is not None:
                return got
        return None
    if isinstance(rec, Mapping):
        if set(rec.keys()) != set(given.keys()):  # (keyword order does not matter)
            return (
                f"{_where(path)} has the keys {sorted(map(str, given))} here, "
                f"{sorted(map(str, rec))} in the record"
            )
        for k in rec:
            got = _difference(rec[k], given[k], f"{path}[{k!r}]", depth - 1)
            if got is not None:
                return got
        return None
    a, b = getattr(rec, "__dict__", None), getattr(given, "__dict__", None)
    if isinstance(a, dict) and isinstance(b, dict):  # an object: its attributes
        return _difference(a, b, f"{path}.__dict__" if path else "__dict__", depth - 1)
    return None


def _aligned(rec: Any, given: Any) -> tuple[str | None, Any]:
    """Where ``given`` differs from ``rec`` other than in values (:func:`_difference`; an
    ``(args, kwargs)`` pair named as such), and ``given`` with its keywords in ``rec``'s order
    (paired by name, not order) for the value comparison."""
    if isinstance(rec, tuple) and len(rec) == 2 and isinstance(given, tuple) and len(given) == 2:
        other = _difference(rec[0], given[0], "args") or _difference(rec[1], given[1], "kwargs")
        if other is None and isinstance(rec[1], Mapping) and isinstance(given[1], Mapping):
            given = (given[0], {k: given[1][k] for k in rec[1]})
        return other, given
    return _difference(rec, given, ""), given


def _check_inputs(ra: RunRecord, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The live run must get the recorded run's inputs: refuse others by name."""
    pos = ra.by_key.get(("", 0))
    if pos is None:
        warnings.warn(
            "hs.compare: the record holds no call of the model itself (recorded with layers= "
            "that leave it out), so the inputs given cannot be checked against the record's: "
            "record with layers including '' (the model) to have them checked",
            HookscopeWarning,
            stacklevel=4,
        )
        return
    rec = ra.calls[pos].inputs
    given = cast_like((tuple(inputs), dict(kwargs)), ra.dtype, torch.device("cpu"))
    other, given = _aligned(rec, given)
    if other is not None:
        raise CompareError(
            f"hs.compare: the inputs given differ from those of the recorded run: {other}; pass "
            "the same inputs the record was made with"
            + (
                f" (its {ra.world} ranks' inputs concatenated in rank order: the ranks are "
                "joined along the first dimension of each tensor, the rank's batch share, so "
                "inputs batched along another dimension, sequence-first (T, B, ...), join as "
                f"({ra.world}*T, B/{ra.world}, ...): record with the batch first, "
                "batch_first=True)"
                if ra.world > 1
                else ""
            )
        )
    err = rel_error(rec, given)
    if err is None or err == 0.0:
        return
    raise CompareError(
        "hs.compare: the inputs given differ from those of the recorded run "
        f"(relative difference {err:.2e}); pass the same inputs the record was made with"
        + (f" (its {ra.world} ranks' inputs concatenated in rank order)" if ra.world > 1 else "")
    )
