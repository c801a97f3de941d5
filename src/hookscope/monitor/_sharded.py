"""Parameter statistics of sharded (``DTensor``) parameters: FSDP2 and tensor parallel.

Each rank holds a shard of a ``DTensor`` parameter (and of its gradient). The norms the monitor
reports are those of the full tensors, computed without gathering them: every rank computes the
sums of squares of its shards (weight, gradient, update, snapshot), divided by the number of ranks
holding a copy of the same values (1 for ``Shard``, the mesh size for each ``Replicate`` dimension;
the world size for a plain, replicated parameter), and the monitor adds these vectors over the
ranks in the one collective it already makes per logged step (:func:`_monitor._gather`), then
takes square roots.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..core._errors import UnsupportedTensorError
from ..core._sharded import (
    check_tensor_type,
    declared_output,
    fsdp_managed,
    is_dtensor,
    local,
    output_kind,
    replication,
)
from ._stats import param_stats

__all__ = [
    "TPLayouts",
    "any_sharded",
    "check_params",
    "local_tensors",
    "sharded_param_sumsq",
    "sum_ranks_sqrt",
    "tensor_parallel",
    "tp_pieces",
]


def any_sharded(params: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Does any parameter of the selection live as a ``DTensor``?"""
    return any(is_dtensor(p) for _, p in params)


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's local shard (a plain tensor detached as is)."""
    return [local(t) for t in tensors]


def sharded_param_sumsq(
    params: Sequence[tuple[str, torch.Tensor]], before: list[torch.Tensor] | None
) -> list[float]:
    """Rows ``[grad, weight, update, before]`` of weighted local sums of squares per parameter,
    flattened, for :func:`sum_ranks_sqrt` to add over the ranks (NaN: no gradient; ``before``:
    local snapshots taken at the start of the step, overwritten)."""
    ws = local_tensors([p for _, p in params])
    gs = [local(p.grad) if p.grad is not None else None for _, p in params]
    norms = param_stats(ws, gs, before)
    if isinstance(norms, torch.Tensor):
        norms = norms.tolist()
    out: list[float] = []
    for j, (name, p) in enumerate(params):
        what = f"parameter {name!r}"
        kw = 1.0 / replication(p, what)
        kg = 1.0 / replication(p.grad, f"the gradient of {what}") if p.grad is not None else 1.0
        gn, wn, un, bn = norms[4 * j : 4 * j + 4]
        out += [gn * gn * kg, wn * wn * kw, un * un * kw, bn * bn * kw]
    return out


def sum_ranks_sqrt(rows: Sequence[Sequence[float]]) -> list[float]:
    """Add the ranks' :func:`sharded_param_sumsq` vectors and take square roots: the norms of the
    full tensors, in the layout of :func:`param_stats`."""
    return [math.sqrt(sum(col)) for col in zip(*rows)]


def check_params(params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse, when the monitor is created, parameters whose statistics it could not reduce: an
    unknown tensor subclass, a ``Partial`` ``DTensor``, a mesh that does not span the world."""
    for name, p in params:
        check_tensor_type(p, f"parameter {name!r}")
        replication(p, f"parameter {name!r}")


def tensor_parallel(model: torch.nn.Module, params: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Is ``model`` split by tensor parallelism (``DTensor`` parameters not managed by FSDP2)?

    Then every rank runs the same batch, and a layer's output is either replicated (the same on
    every rank, e.g. after a ``RowwiseParallel`` layer) or a shard of the full output (after a
    ``ColwiseParallel`` layer). Raises for FSDP2 combined with tensor parallelism (2-D meshes),
    whose layer statistics mix both rules.
    """
    tp = [n for n, p in params if is_dtensor(p) and not fsdp_managed(model, n)]
    fsdp = [n for n, p in params if is_dtensor(p) and fsdp_managed(model, n)]
    if tp and fsdp:
        raise UnsupportedTensorError(
            f"Monitor: parameters {tp[:2]} are tensor-parallel DTensors and {fsdp[:2]} are sharded "
            "by FSDP2 in the same model; layer statistics of a 2-D (data x tensor) parallel model "
            "are not supported. Monitor parameters only: stats=('parameters',)"
        )
    return bool(tp)


def tp_pieces(
    ns: list[float], vs: list[list[float]], replicated: bool
) -> tuple[list[float], list[list[float]]]:
    """Under tensor parallelism, a layer's per-rank ``(count, statistics)``: one rank's for a
    replicated output (counting each copy would repeat its values), else every rank's (disjoint
    shards of the full output, combined as one tensor). ``replicated`` comes from
    :class:`TPLayouts`, never from comparing the values (an all-zero shard looks replicated)."""
    return (ns[:1], vs[:1]) if replicated else (ns, vs)


class TPLayouts:
    """Which layer outputs of a tensor-parallel model are shards and which are replicated, from
    what the model declares, in this order:

    1. a ``DTensor`` output: its placements;
    2. a module the parallelize plan names: the plan's output layout (``ColwiseParallel``:
       ``Shard(-1)`` by default, ``RowwiseParallel``: ``Replicate()``, ...);
    3. an output that is the very tensor an earlier layer of this forward pass returned (a
       container returning its last child's output): that layer's layout;
    4. a module whose inputs include outputs of earlier layers: sharded if one of them is (an
       elementwise layer after a ``ColwiseParallel`` one works on the shard);
    5. otherwise the layout of the last layer that ran (the input came through functional code).

    Every rank runs the same code on the same plan, so every rank decides alike.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.declared = {id(m): k for m in model.modules() if (k := declared_output(m)) is not None}
        self._marks: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._last = "replicate"

    def plan_modules(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The modules the plan names (hooked to mark their outputs even when not monitored)."""
        return [(n, m) for n, m in model.named_modules() if id(m) in self.declared]

    def reset(self) -> None:
        """A new forward pass."""
        self._marks.clear()
        self._last = "replicate"

    def _known(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        mark = self._marks.get(id(t))
        return mark[1] if mark is not None and mark[0]() is t else None

    def kind(self, name: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> str:
        """``"shard"`` or ``"replicate"`` for output ``t`` of layer ``name``; remembers it."""
        what = f"the output of layer {name!r}"
        if is_dtensor(t):
            k = output_kind(t, what)
        else:
            declared = self.declared.get(id(module))
            if declared == "partial":
                raise UnsupportedTensorError(
                    f"{what} is declared Partial by the tensor-parallel plan: its shards are not "
                    "its values, so its statistics cannot be combined. Declare Shard or Replicate "
                    "output layouts for it, or exclude it from the monitored layers"
                )
            k = declared or self._known(t)
            if k is None:
                ins = [self._known(a) for a in (args if isinstance(args, tuple) else (args,))]
                ins = [x for x in ins if x is not None]
                k = ("shard" if "shard" in ins else "replicate") if ins else self._last
        self._marks[id(t)] = (weakref.ref(t), k)
        self._last = k
        return k
