"""A layer's sites as one batched job: pack sites into the rows of a pass, chunked by a budget.

A sweep runs the model many times on the same batch of ``B`` rows with one site patched each.
Instead of one forward per site, ``k`` sites go into one pass of ``k * B`` rows, laid out
site-major: rows ``[j*B, (j+1)*B)`` are site ``j`` (:func:`tile`). :func:`plan` picks ``k`` from
a budget in bytes (or a number of rows); :func:`plan_from` groups the sites of a causal model by
the first position they change.

:class:`FanOut` goes further: the model runs on the ``B`` rows only up to the module where the
rows start, since what comes before cannot differ between sites; there it tiles the values to
``k * B`` rows, and forward-pre hooks on every module called later from the frames still running
(the later blocks, the final norm, the head) tile any argument whose leading dimension is ``B``
(attention masks, position embeddings). No per-architecture code: a model that computes
something from the ``B`` rows outside a module call and mixes it in later gets a shape error
(``B`` and ``k * B`` rows do not broadcast for ``B > 1``; for ``B == 1`` broadcasting gives the
same values), so callers check a batched pass against one site alone and fall back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._nested import map_tensors
from ..core._scope import HookScope

__all__ = ["FanOut", "default_budget", "later_callees", "plan", "plan_from", "tile"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def tile(
    obj: Any, batch: int, k: int, memo: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> Any:
    """``obj`` with every tensor whose leading dimension is ``batch`` repeated ``k`` times along
    it (rows ``[j*batch, (j+1)*batch)`` are copy ``j``); other values kept. ``memo`` (by ``id``)
    tiles a tensor met again (a mask passed to every block) only once.

    >>> tile((torch.tensor([[1], [2]]), 5), 2, 2)[0].flatten().tolist()
    [1, 2, 1, 2]
    """
    if k == 1:
        return obj

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or t.shape[0] != batch:
            return t
        if memo is not None:
            hit = memo.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        out = t.unsqueeze(0).expand(k, *t.shape).reshape(k * batch, *t.shape[1:])
        if memo is not None:
            memo[id(t)] = (t, out)  # holds the source: its id stays unique within the pass
        return out

    return map_tensors(one, obj)


def default_budget(device: torch.device) -> int:
    """Bytes a sweep may use for its rows: half the free memory of a CUDA device; on the CPU a
    quarter of the available memory, at most 2 GiB."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free // 2)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 << 30
    return int(min(avail // 4, 2 << 30))


def plan(
    n: int, batch: int, *, bytes_per_row: int, rows: int | None = None, budget: int
) -> list[range]:
    """Split ``n`` changes into chunks of ``k`` per pass: ``k = rows // batch`` if ``rows`` is
    given, else as many as fit ``budget`` bytes at ``bytes_per_row``; at least 1, at most ``n``.

    >>> plan(5, 2, bytes_per_row=10, budget=45)
    [range(0, 2), range(2, 4), range(4, 5)]
    """
    if rows is not None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1 (rows per pass), got {rows}")
        k = max(1, rows // batch)
    else:
        k = max(1, budget // max(1, bytes_per_row * batch))
    k = min(k, max(1, n))
    return [range(i, min(i + k, n)) for i in range(0, n, k)]


def plan_from(
    firsts: Sequence[int],
    length: int,
    batch: int,
    *,
    bytes_per_row: Callable[[int], int],
    rows: int | None = None,
    budget: int,
    shared: float = 0.0,
) -> list[tuple[int, list[int]]]:
    """Group changes into passes that each run positions ``p0..length-1`` only, ``p0`` the
    smallest first position touched (``firsts[i]``) among a pass's changes (a causal model: the
    positions before are the reference run's). Returns ``(p0, [change indices])`` per pass.

    A pass costs ``length / 4 + (k + shared) * (length - p0)`` row-positions per batch row
    (``length / 4``: a pass's fixed cost; ``shared``: what every pass
    computes once whatever its ``k``, e.g. the blocks before the rows fan out, in units of one
    change's rows); changes sorted by first position are cut
    into the passes of least total cost (a dynamic programme over the groups of one first
    position), each holding at most ``rows // batch`` changes, or as many as fit ``budget`` at
    ``bytes_per_row(p0)``.

    >>> plan_from([0, 3, 3, 1], 4, 1, bytes_per_row=lambda p: 1, budget=2)
    [(0, [0, 3]), (3, [1, 2])]
    """
    if rows is not None and rows < 1:
        raise ValueError(f"rows must be >= 1 (rows per pass), got {rows}")
    cost0 = length / 4  # a pass's fixed cost (calibrated on GPT-2, benchmarks/README.md)

    def kmax(p: int) -> int:
        if rows is not None:
            return max(1, rows // batch)
        return max(1, budget // max(1, bytes_per_row(p) * batch))

    by_first: dict[int, list[int]] = {}
    for i in sorted(range(len(firsts)), key=lambda i: firsts[i]):
        by_first.setdefault(int(firsts[i]), []).append(i)
    full: list[tuple[int, list[int]]] = []  # passes as large as the budget allows
    units: list[tuple[int, list[int]]] = []  # what is left of each group, merged below
    for p, idx in by_first.items():
        k = kmax(p)
        while len(idx) > k:
            full.append((p, idx[:k]))
            idx = idx[k:]
        units.append((p, idx))
    m = len(units)
    best = [0.0] + [float("inf")] * m
    cut = [0] * (m + 1)
    for i in range(m):  # forward: a pass of units i..j-1 starts at units[i]'s position
        p, k, n = units[i][0], kmax(units[i][0]), 0
        for j in range(i + 1, m + 1):
            n += len(units[j - 1][1])
            if n > k:
                break
            c = best[i] + cost0 + (n + shared) * (length - p)
            if c < best[j]:
                best[j], cut[j] = c, i
    merged: list[tuple[int, list[int]]] = []
    j = m
    while j > 0:
        i = cut[j]
        merged.append((units[i][0], [x for u in units[i:j] for x in u[1]]))
        j = i
    return sorted(full + merged[::-1], key=lambda pc: pc[0])


class FanOut:
    """Run ``batch`` rows up to module ``start``, then ``k * batch`` rows from there on
    (``modules``: the model's modules by name, as ``core._compiled.named_modules`` gives them).

    With ``at="input"`` the tiling happens in a forward-pre hook of ``start`` (its inputs), with
    ``at="output"`` in a forward hook (its output). Forward-pre hooks (``with_kwargs``) on every
    module that a frame still running at that point calls afterwards (the later siblings of
    ``start`` and of each of its ancestors, looking through ``ModuleList``/``ModuleDict``) tile
    their arguments. Set :attr:`k` and call :meth:`reset` before each pass; hooks live in
    ``scope``. Tiling in a pass happens once, on ``start``'s first call.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        start: str,
        batch: int,
        scope: HookScope,
        *,
        at: Literal["input", "output"] = "input",
    ) -> None:
        self.batch, self.k, self.active = batch, 1, False
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if at == "input":
            scope.add_forward_pre(modules[start], self._start_pre, layer=start, with_kwargs=True)
        else:
            scope.add_forward(modules[start], self._start_post, layer=start)
        for name in later_callees(modules, start):
            scope.add_forward_pre(modules[name], self._later, layer=name, with_kwargs=True)

    def reset(self, k: int) -> None:
        """Prepare the next pass: ``k`` copies, nothing tiled yet."""
        self.k, self.active = k, False
        self.memo.clear()

    def _start_pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self.active:
            return None
        self.active = True
        return tile(args, self.batch, self.k, self.memo), tile(
            kwargs, self.batch, self.k, self.memo
        )

    def _start_post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.active:
            return None
        self.active = True
        return tile(output, self.batch, self.k, self.memo)

    def _later(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not self.active or self.k == 1:
            return None
        return tile(args, self.batch, self.k, self.memo), tile(
            kwargs, self.batch, self.k, self.memo
        )


def later_callees(modules: dict[str, nn.Module], start: str) -> list[str]:
    """The modules a running frame may call after ``start``: the siblings of ``start`` and of each
    of its ancestors (children of containers without a ``forward`` counted as siblings)."""
    if not start:
        return []
    parts = start.split(".")
    path = {".".join(parts[:i]) for i in range(len(parts) + 1)}
    out: list[str] = []

    def children(parent: str) -> list[str]:
        depth = 0 if not parent else parent.count(".") + 1
        pre = parent + "." if parent else ""
        return [n for n in modules if n.startswith(pre) and n and n.count(".") == depth]

    def visit(parent: str) -> None:
        for c in children(parent):
            if c in path:
                if isinstance(modules[c], _CONTAINERS):
                    visit(c)
                continue
            if isinstance(modules[c], _CONTAINERS):
                visit(c)
            else:
                out.append(c)

    for i in range(len(parts)):
        anc = ".".join(parts[:i])
        if not (anc and isinstance(modules[anc], _CONTAINERS)):
            visit(anc)
    return out
