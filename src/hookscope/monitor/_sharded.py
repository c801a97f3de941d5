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
from collections.abc import Sequence

import torch

from ..core._sharded import check_tensor_type, is_dtensor, local, replication
from ._stats import param_stats

__all__ = ["any_sharded", "check_params", "local_tensors", "sharded_param_sumsq", "sum_ranks_sqrt"]


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
