"""The records of the ranks of one ``torch.distributed`` run (each rank its share of the batch),
joined into the record of one process running the combined batch.

Join rule, per module call (matched across ranks by name and occurrence) and per tensor leaf of
its inputs, output and gradients: a leaf whose first dimension equals the rank's batch share on
every rank (the share: the first dimension of the first tensor input of the rank's first recorded
call) is concatenated in rank order; any other leaf must be equal on every rank and is taken once
(its gradient, the gradient of a value every rank's share used, is the sum of the ranks' own);
a leaf that is both (the share's length and equal on every rank: a ``(T, T)`` mask where the
sequence length equals the share) is decided by the other run's shape of it (:func:`shapes_from`);
otherwise the call cannot be joined and its row says so. Activation gradients are rescaled to the
combined run's loss: with ``loss_reduction="mean"`` each rank's gradient is multiplied by its
share of the combined batch (``1/world`` for equal shares); with ``"sum"`` they are taken as they
are. Parameter gradients are the ranks' shared (averaged) ones: equal to the combined run's with a
mean loss and equal shares, multiplied by ``world`` with a sum. A module that ran a different
number of times on different ranks is left out of the pairing and listed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

from ..core._nested import continuous, iter_tensors, map_tensors
from ._run import CallRec, CompareError, RunRecord

__all__ = ["REDUCTIONS", "join_ranks", "shapes_from"]

REDUCTIONS = ("mean", "sum")
_RECENT = 8  # joined values kept: a row and its replay read the same few values again
_ATTR = {"in": "inputs", "out": "output", "grad": "grad", "ingrad": "in_grad"}


def join_ranks(recs: list[RunRecord], loss_reduction: str = "mean") -> RunRecord:
    """One run on the combined batch, from the records of ``len(recs)`` ranks (module doc)."""
    if loss_reduction not in REDUCTIONS:
        raise CompareError(
            f"hs.compare: loss_reduction={loss_reduction!r} is not one of 'mean', 'sum' (how the "
            "loss of each rank reduced its share of the batch)"
        )
    world = len(recs)
    shares = [_share(r) for r in recs]
    total = sum(shares)
    grads = all(r.has_grads for r in recs)
    if grads and loss_reduction == "mean" and len(set(shares)) > 1:
        raise CompareError(
            f"hs.compare: the ranks recorded unequal batch shares {shares} with a mean loss: the "
            "averaged parameter gradients are not the combined run's; record equal shares, or "
            "pass loss_reduction='sum' if each rank's loss was a sum"
        )
    counts = [Counter(c.name for c in r.calls) for r in recs]
    excluded = {
        name: "ran " + "/".join(str(n[name]) for n in counts) + f" times on ranks 0-{world - 1}"
        for name in set().union(*counts)
        if len({n[name] for n in counts}) > 1
    }
    scale = [s / total for s in shares] if loss_reduction == "mean" else [1.0] * world
    base = recs[0]
    notes: dict[int, str] = {}
    store = _Joined(recs, shares, scale, excluded, notes)
    calls = []
    for c in base.calls:
        j = CallRec(c.name, c.index, c.start, c.parent, alias=c.alias, store=store)  # type: ignore[arg-type]
        j.end, j.children = c.end, list(c.children)
        calls.append(j)
    store.calls = calls
    pscale = float(world) if loss_reduction == "sum" else 1.0
    params = {
        n: None if g is None else g * pscale if pscale != 1.0 else g
        for n, g in base.param_grads.items()
    }
    return RunRecord(
        model=base.model,
        calls=calls,
        by_key={c.key: i for i, c in enumerate(calls)},
        param_grads=params,
        dtype=base.dtype,
        has_grads=grads,
        params=base.params,
        world=world,
        excluded=excluded,
        notes=notes,
        partial_grads=any(r.partial_grads for r in recs),
        lost={k: v for r in recs for k, v in r.lost.items()},
        elsewhere={k: v for r in recs for k, v in r.elsewhere.items()},
        modes=base.modes,
        outside={n for r in recs for n in r.outside},
        loss_inside={n for r in recs for n in r.loss_inside},
        moved=base.moved,
        moved_cast=base.moved_cast,
        quantized=base.quantized,
    )


def _equal(ts: tuple[torch.Tensor, ...]) -> bool:
    """Whether leaves ``ts`` (one per rank) are the same tensor value on every rank."""
    return len({t.shape for t in ts}) == 1 and all(torch.equal(ts[0], t) for t in ts)


def _share(rec: RunRecord) -> int:
    if rec.calls:
        for _, t in iter_tensors(rec.calls[0].inputs):
            if t.dim() >= 1:
                return int(t.shape[0])
    raise CompareError(
        "hs.compare: a rank's record has no tensor input with a batch dimension; the ranks "
        "cannot be joined into one run"
    )


class _Joined:
    """The store of the joined calls: ``get("out12")`` reads every rank's value of that call and
    joins it; what cannot be joined is noted in ``notes[pos]`` (rank 0's value stands in)."""

    def __init__(
        self,
        recs: list[RunRecord],
        shares: list[int],
        scale: list[float],
        excluded: dict[str, str],
        notes: dict[int, str],
    ) -> None:
        self.recs, self.shares, self.scale = recs, shares, scale
        self.excluded, self.notes = excluded, notes
        self.calls: list[CallRec] = []
        self._recent: OrderedDict[str, Any] = OrderedDict()  # the last joined values, bounded
        # the run compared with this one, on the combined batch: ``combined(pos, "in" | "out")``
        # gives the shapes of its leaves of that call (``None``: not known); see _leaf
        self.combined: Any = None

    def set_combined(self, combined: Any) -> None:
        """The shapes of the other run's values (:func:`shapes_from`): what decides a leaf
        that is both split-shaped and equal on every rank (see :meth:`_leaf`)."""
        self.combined = combined
        self._recent.clear()

    def get(self, key: str, default: Any = None) -> Any:
        # copies handed out: a replayed module may change its inputs in place
        if key in self._recent:
            self._recent.move_to_end(key)
            return map_tensors(torch.clone, self._recent[key])
        value = self._get(key, default)
        self._recent[key] = value
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return map_tensors(torch.clone, value)

    def _get(self, key: str, default: Any) -> Any:
        kind = key.rstrip("0123456789")
        pos = int(key[len(kind) :])
        call = self.calls[pos]
        if call.name in self.excluded:
            return default
        values = []
        for r in self.recs:
            i = r.by_key.get(call.key)
            values.append(None if i is None else getattr(r.calls[i], _ATTR[kind]))
        if all(v is None for v in values):
            return default
        # the forward leaves these values are, or are the gradients of ("grad": the output's,
        # "ingrad": the inputs'), and the other run's shapes of them
        fwd = "in" if kind in ("in", "ingrad") else "out"
        shapes = self.combined(pos, fwd) if self.combined is not None else None
        if kind.endswith("grad") and all(isinstance(v, list) for v in values):
            # a leaf equal on every rank (not split by batch) takes their sum
            leaves = []
            for r in self.recs:
                i = r.by_key.get(call.key)
                v = None if i is None else getattr(r.calls[i], _ATTR[fwd])
                leaves.append([t for _, t in iter_tensors(v)])
            joined, why = self._join_grads(values, leaves, shapes)
        else:
            joined, why = self._join(values, kind.endswith("grad"), shapes)
        if why is not None:
            self.notes.setdefault(pos, f"ranks cannot be joined: {_ATTR[kind]} {why}")
        return joined

    def put(self, key: str, value: Any) -> None:
        raise CompareError("a record read from disk is read-only")

    def _split(self, ts: tuple[torch.Tensor, ...]) -> bool:
        """Whether leaves ``ts`` (one per rank) are the ranks' batch shares along dim 0."""
        return all(t.dim() >= 1 and t.shape[0] == n for t, n in zip(ts, self.shares)) and (
            len({t.shape[1:] for t in ts}) == 1
        )

    def _join_grads(
        self,
        values: list[list[Any]],
        forward: list[list[torch.Tensor]],
        shapes: list[tuple[int, ...]] | None = None,
    ) -> tuple[Any, str | None]:
        """Gradients (one list per rank, an entry per forward leaf), rescaled to the combined
        run's loss: a leaf the ranks split by batch is concatenated; a leaf whose forward value
        is the same on every rank (a position embedding's output, a shared mask) was used by
        every rank's share, so its combined gradient is the sum of the ranks' own."""
        n = len(values[0])
        if any(len(v) != n for v in values):
            return values[0], "has a different structure on different ranks"
        out: list[Any] = []
        why = None
        for k in range(n):
            ts = tuple(v[k] for v in values)
            if all(t is None for t in ts):
                out.append(None)
                continue
            if any(t is None for t in ts):
                why = why or f"leaf {k} is missing on some ranks"
                out.append(ts[0])
                continue
            ts = tuple(t * s if continuous(t) else t for t, s in zip(ts, self.scale))
            fs = tuple(f[k] if k < len(f) else None for f in forward)
            shape = shapes[k] if shapes is not None and k < len(shapes) else None
            shared = (
                all(f is not None for f in fs)
                and _equal(fs)  # type: ignore[arg-type]
                and (not self._split(fs) or self._once(fs, shape))  # type: ignore[arg-type]
            )
            if shared and len({t.shape for t in ts}) == 1:
                out.append(torch.stack(ts).sum(0))
                continue
            joined, bad = self._leaf(k, ts, "the gradient of a value equal on every rank", shape)
            out.append(joined)
            why = why or bad
        return out, why

    def _once(self, ts: tuple[torch.Tensor, ...], shape: tuple[int, ...] | None) -> bool:
        """Leaves ``ts``, split-shaped and equal on every rank, are one value taken once, not
        the ranks' batch shares: the combined run's leaf has the shape of one rank's (a mask or
        table of ``(T, T)`` where the sequence length equals the share), not of their
        concatenation. Without the other run's shape (``None``) they are batch shares (a
        position tensor expanded over the batch, the common case)."""
        return shape is not None and tuple(ts[0].shape) == tuple(shape) and len(ts) > 1

    def _leaf(
        self,
        k: int,
        ts: tuple[torch.Tensor, ...],
        equal: str,
        shape: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, str | None]:
        """One leaf of the ranks joined: concatenated where the ranks split it by batch, one
        rank's where all are equal; else rank 0's, with why it cannot be joined (``equal``: what
        it would have to be equal as). ``shape``: the combined run's shape of this leaf, which
        decides a leaf that is both (:meth:`_once`)."""
        if self._split(ts):
            if self._once(ts, shape) and _equal(ts):
                return ts[0], None
            return torch.cat(ts), None
        if _equal(ts):
            return ts[0], None
        return ts[0], (
            f"leaf {k} (shapes {[tuple(t.shape) for t in ts]}) is neither the ranks' batch "
            f"shares {self.shares} along dim 0 nor {equal}"
        )

    def _join(
        self, values: list[Any], grad: bool, shapes: list[tuple[int, ...]] | None = None
    ) -> tuple[Any, str | None]:
        if any(v is None for v in values):
            return values[0], "missing on some ranks"
        leaves = [[t for _, t in iter_tensors(v)] for v in values]
        if len({len(x) for x in leaves}) > 1:
            return values[0], "has a different structure on different ranks"
        out: list[torch.Tensor] = []
        why = None
        for k, ts in enumerate(zip(*leaves)):
            if grad:
                ts = tuple(t * s if continuous(t) else t for t, s in zip(ts, self.scale))
            shape = shapes[k] if shapes is not None and k < len(shapes) else None
            joined, bad = self._leaf(k, ts, "equal on every rank", shape)
            out.append(joined)
            why = why or bad
        it = iter(out)
        return map_tensors(lambda _t: next(it), values[0]), why


def shapes_from(rec: RunRecord, other: RunRecord, to_other: Any) -> None:
    """Tell a joined record ``rec`` (the ranks of one run) the shapes of ``other``'s values (a
    run on the combined batch: a live model's, or another record), by call: what decides its
    leaves that are both split-shaped and equal on every rank (:meth:`_Joined._once`).
    ``to_other``: ``rec``'s module names to ``other``'s. Nothing for a record of one process."""
    store = rec.calls[0].store if rec.calls else None
    if rec.world <= 1 or other.world > 1 or not isinstance(store, _Joined):
        return  # (two records of ranks join alike: neither is the combined run)

    def combined(pos: int, kind: str) -> list[tuple[int, ...]] | None:
        c = rec.calls[pos]
        name = to_other(c.name)
        j = other.by_key.get((name, c.index)) if name is not None else None
        if j is None:
            return None
        oc = other.calls[j]
        if kind == "in" and oc.in_shapes is not None:
            return oc.in_shapes
        value = oc.inputs if kind == "in" else oc.output
        if value is None:
            return None
        return [tuple(t.shape) for _, t in iter_tensors(value)]

    store.set_combined(combined)
