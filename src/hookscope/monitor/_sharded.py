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

from ..core._errors import UnsupportedTensorError
from ..core._sharded import check_tensor_type, fsdp_managed, is_dtensor, local, replication
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


def tp_pieces(ns: list[float], vs: list[list[float]]) -> tuple[list[float], list[list[float]]]:
    """Under tensor parallelism, a layer's per-rank ``(count, statistics)``: one rank's when every
    rank computed the very same vector (a replicated output: counting each copy would repeat its
    values), else every rank's (disjoint shards of the full output, combined as one tensor)."""
    if all(v == vs[0] for v in vs[1:]) and all(n == ns[0] for n in ns[1:]):
        return ns[:1], vs[:1]
    return ns, vs
