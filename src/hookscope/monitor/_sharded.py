"""Parameter statistics of sharded (``DTensor``) parameters: FSDP2 and tensor parallel.

Each rank holds a shard of a ``DTensor`` parameter (and of its gradient). The norms the monitor
reports are those of the full tensors, computed without gathering them: every rank computes the
sums of squares of its shards (weight, gradient, update, snapshot), divided by the number of ranks
holding a copy of the same values (1 for ``Shard``, the mesh size for each ``Replicate`` dimension;
the world size for a plain, replicated parameter), and the monitor adds these vectors over the
ranks in the one collective it already makes per logged step (:func:`_pack._gather`), then
takes square roots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..core._ddp import wrapping_ddp
from ..core._errors import UnsupportedTensorError
from ..core._sharded import (
    TPLayouts,
    check_tensor_type,
    is_dtensor,
    local,
    plan_mesh,
    replication,
)
from ._stats import param_stats

__all__ = [
    "TPLayouts",
    "any_sharded",
    "check_params",
    "grads_reduced",
    "local_tensors",
    "origin_across_ranks",
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


def tensor_parallel(model: torch.nn.Module) -> tuple[int, list[int]] | None:
    """``(data-parallel size, each rank's tensor-parallel coordinate)`` for a model split by a
    tensor-parallel plan (``parallelize_module``), alone or with FSDP2 on a 2-D mesh; else None.

    Ranks with the same data-parallel coordinate run the same batch, and a layer's output is
    either replicated over the tensor-parallel dimension (after a ``RowwiseParallel`` layer) or a
    shard of the full output (after a ``ColwiseParallel`` layer): see :class:`TPLayouts`. The
    coordinates are gathered once (every rank builds its monitor).
    """
    import torch.distributed as dist

    meshes = {id(m): m for m in map(plan_mesh, model.modules()) if m is not None}
    if not meshes:
        return None
    if len(meshes) > 1 and len({tuple(m.mesh.flatten().tolist()) for m in meshes.values()}) > 1:
        raise UnsupportedTensorError(
            "Monitor: the tensor-parallel plan of this model uses several device meshes; layer "
            "statistics need one. Monitor parameters only: stats=('parameters',)"
        )
    tp = next(iter(meshes.values()))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if tp.ndim != 1 or world % tp.size():
        raise UnsupportedTensorError(
            f"Monitor: the tensor-parallel mesh {tp} does not tile the world of {world} ranks; "
            "layer statistics need a 1-D tensor-parallel mesh (a dimension of the world's mesh). "
            "Monitor parameters only: stats=('parameters',)"
        )
    coords: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(coords, tp.get_local_rank())
    else:
        coords = [0]
    return world // tp.size(), [int(c) for c in coords]


def tp_pieces(
    ns: list[float], vs: list[list[float]], replicated: bool, coords: list[int]
) -> tuple[list[float], list[list[float]]]:
    """Under tensor parallelism, a layer's per-rank ``(count, statistics)``: for a replicated
    output, those of the ranks at tensor-parallel coordinate 0 (one per data-parallel group:
    counting each copy would repeat its values), else every rank's (disjoint shards of the full
    output, combined as one tensor). ``replicated`` comes from :class:`TPLayouts`, never from
    comparing the values (an all-zero shard looks replicated)."""
    if not replicated:
        return ns, vs
    keep = [i for i, c in enumerate(coords) if c == 0]
    return [ns[i] for i in keep], [vs[i] for i in keep]


def grads_reduced(model: torch.nn.Module) -> bool:
    """Are ``model``'s gradients reduced across ranks (a ``DistributedDataParallel`` in it or
    wrapping it, or ``DTensor`` parameters: FSDP2, tensor parallel)? Only then can a NaN made on
    one rank reach another's parameter gradients (:func:`origin_across_ranks`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    ddp = torch.nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in model.modules()) or any(
        is_dtensor(p) for p in model.parameters()
    ):
        return True
    return wrapping_ddp(model) is not None


def origin_across_ranks(
    origin: Any, own: bool, reduced: bool, step: int = 0
) -> tuple[Any, int | None]:
    """Under torch.distributed: the NaN/Inf origin this rank reports, and the rank that saw it.

    A gradient reduction (DDP's all-reduce, FSDP2's reduce-scatter) carries a NaN made on one rank
    into the parameter gradients of every rank: a rank whose own forward and backward were finite
    sees only those, and on its own would blame the last layer whose parameter gradient is not
    finite (``own=False``: the sentinel's fallback), or see nothing (its shards are empty or
    finite). So the ranks agree: the lowest rank that found an origin in its own module graph
    (``own=True``) gives it to every rank that did not. One ``all_reduce`` of one number per
    sentinel check, and one broadcast at a step where some rank found an origin. ``(origin,
    None)`` for a model whose gradients are not reduced across ranks (``reduced``, from
    :func:`grads_reduced`: then no collective is made, and a monitor may run on one rank alone),
    or when no rank found one in its module graph. The same ``all_reduce`` compares the ranks'
    ``step`` (each monitor's own count): ranks at different steps raise, on every rank, instead
    of handing each other the origins of other steps."""
    import torch.distributed as dist

    if not reduced:
        return origin, None
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu")
    if dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    first = torch.tensor([rank if origin is not None and own else world, step, -step], device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src, low, high = (int(v) for v in first.tolist())
    if low != -high:
        raise RuntimeError(
            f"Monitor: the ranks are at different steps (from {low} to {-high}): each rank "
            "numbers its steps by its own monitor.step() calls, and the sentinel's ranks "
            "exchange what they found each step, so they would mix different steps. Call "
            "monitor.step() on every rank once per optimizer step, also on a step a rank skips "
            "(a NaN loss, an empty batch), with the same first_step on every rank"
        )
    if src == world:
        return origin, None if origin is None else rank
    box = [origin]
    dist.broadcast_object_list(box, src=src, device=dev)
    if origin is not None and own:
        return origin, rank  # this rank's own module graph made one too: its own
    return box[0], src
