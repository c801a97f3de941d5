"""The exact checkpointing planner: a Pareto frontier of (recompute FLOPs, saved bytes) per subtree.

A storage stays saved under a set S of checkpointed modules (none inside another) iff one of its
*keepers* stays: a save event whose module stack holds no module of S, or a call of a module of S
that takes it as an input, keyword ones included (the checkpoint keeps its inputs). Each keeper
sits at a node of the module tree: an event at the innermost module running, an input at the
called module.

For a subtree T(v), a storage whose keepers are all inside it is *settled* there (its bytes count
once the choices inside T(v) are made); one with keepers inside and outside is on the boundary,
and the subtree only reports whether it keeps it (a bit of a mask). For every boundary mask a
subtree holds the Pareto frontier of cost (recompute FLOPs, then number of modules) against
settled bytes. A node is either checkpointed (its subtree's saves go, its inputs stay) or
combines its children's frontiers and keeps its own operations' saves. The root's frontier holds
every plan that no other beats on both cost and bytes: the cheapest one under the budget is the
least-FLOPs plan. Boundaries are small (the tensors passed between neighbouring modules).

With a budget, points that cannot fit whatever the rest of the model does are dropped as soon as
they appear: a point's settled bytes, plus the least bytes every other part of the model can get
to (a first pass, cost ignored), plus what is kept whatever is chosen, must fit. That keeps the
frontiers of long stacks of blocks small; ``max_points`` bounds them anyway (the plan is then
marked approximate).

Exact where each saving module's call stack is its path in the module tree (a module registered
in one place and called from another is not); the plan is checked with
:func:`~hookscope.memory._plan.saved_after` in any case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from ..core._scope import ancestors

if TYPE_CHECKING:
    from ._profile import MemoryProfile

__all__ = ["Frontier", "frontier"]

# a point: (recompute FLOPs, modules, settled bytes, chosen modules as a tree of pairs)
_Point = tuple[int, int, int, Any]
_Front = dict[int, list[_Point]]  # boundary mask -> Pareto points, cheapest first


@dataclass
class Frontier:
    """The root's frontier: ``plans`` as ``(flops, modules, saved bytes, names)``, cheapest
    first, each saving fewer bytes than the one before; ``exact`` is False when a frontier was
    thinned to ``max_points``."""

    plans: list[tuple[int, int, int, list[str]]]
    exact: bool


def _names(sel: Any) -> list[str]:
    out: list[str] = []
    todo = [sel]
    while todo:
        s = todo.pop()
        if s is None:
            continue
        if isinstance(s, str):
            out.append(s)
        else:
            todo.extend(s)
    return out


def _pareto(points: list[_Point], limit: float, cap: float = float("inf")) -> list[_Point]:
    """The points no other beats on both cost and bytes, cheapest first; none above ``limit``
    bytes or ``cap`` FLOPs."""
    points.sort(key=lambda p: (p[0], p[1], p[2]))
    out: list[_Point] = []
    for p in points:
        if p[0] > cap:
            break
        if p[2] <= limit and (not out or p[2] < out[-1][2]):
            out.append(p)
    return out


class _Problem:
    def __init__(self, profile: MemoryProfile, max_points: int) -> None:
        self.max_points = max_points
        self.cap: float = float("inf")  # the most recompute FLOPs a point may cost
        self.lb: dict[str, int] = {}  # node -> least settled bytes of its subtree
        rows = {r.name: r for r in profile.rows}
        self.rows = rows
        self.excluded = set(profile.excluded)  # never checkpointed (see MemoryProfile.excluded)
        self.children: dict[str, list[str]] = {n: [] for n in rows}
        for n in rows:
            if n:
                self.children[next(p for p in ancestors(n) if p in rows)].append(n)
        index: dict[Any, int] = {}
        self.sizes: list[int] = []
        self.keepers: list[set[str]] = []
        always: set[int] = set()
        self.own: dict[str, int] = {}  # node -> mask of storages its own operations save
        self.inputs: dict[str, int] = {}  # module -> mask of storages its calls take as inputs

        def idx(key: Any, n: int) -> int:
            i = index.get(key)
            if i is None:
                i = index[key] = len(self.sizes)
                self.sizes.append(n)
                self.keepers.append(set())
            return i

        for e in profile._events:
            if e.param:
                continue
            i = idx(e.key, e.nbytes)
            where = next((n for n in reversed(e.stack) if n in rows), "")
            if not where:  # outside every module, or the model's own operation: always kept
                always.add(i)
                continue
            self.keepers[i].add(where)
            self.own[where] = self.own.get(where, 0) | (1 << i)
        for call in profile._calls:
            if call.module and call.module in rows:
                for key, n in call.inputs:
                    i = idx(key, n)
                    self.keepers[i].add(call.module)
                    self.inputs[call.module] = self.inputs.get(call.module, 0) | (1 << i)
        self.always = 0
        for i in always:
            self.always |= 1 << i
        self.base = sum(self.sizes[i] for i in always)
        self.at: dict[str, list[int]] = {}  # node -> storages it keeps (not always kept)
        for i, ks in enumerate(self.keepers):
            if i not in always:
                for k in ks:
                    self.at.setdefault(k, []).append(i)
        # which storages each subtree settles, bottom-up
        self.settled: dict[str, int] = {}
        self._count("")
        self.thinned = False  # a frontier was cut to max_points

    def _count(self, v: str) -> dict[int, int]:
        counts = {i: 1 for i in self.at.get(v, ())}
        for c in self.children[v]:
            for i, n in self._count(c).items():
                counts[i] = counts.get(i, 0) + n
        inner = 0
        for i, n in counts.items():
            if n == len(self.keepers[i]):
                inner |= 1 << i
        self.settled[v] = inner
        return counts

    def _bytes(self, mask: int) -> int:
        total = 0
        while mask:
            low = mask & -mask
            total += self.sizes[low.bit_length() - 1]
            mask ^= low
        return total

    def walk(self, v: str, limit: float, *, least: bool = False) -> _Front:
        """Frontier of T(v). ``limit``: the most settled bytes a point of T(v) may have (the
        budget, less what is always kept and the least the rest of the model can keep).
        ``least=True``: bytes only (one point per mask), recording ``self.lb``."""
        kids = self.children[v]
        lb = self.lb
        front: _Front = {self.own.get(v, 0) & ~self.always: [(0, 0, 0, None)]}
        total = sum(lb.get(c, 0) for c in kids)
        rest = total  # least bytes of the children not combined yet
        for c in kids:
            rest -= lb.get(c, 0)
            sub = self.walk(c, limit - (total - lb.get(c, 0)), least=least)
            got: dict[int, list[_Point]] = {}
            for ma, pa in front.items():
                for mb, pb in sub.items():
                    lst = got.setdefault(ma | mb, [])
                    for fa, ka, ba, sa in pa:
                        for fb, kb, bb, sb in pb:
                            lst.append((fa + fb, ka + kb, ba + bb, (sa, sb)))
            front = self._prune(got, limit - rest)
        row = self.rows[v]
        if (
            v and row.calls > 0 and v not in self.excluded
        ):  # checkpointed: its subtree's saves go, its inputs stay
            m = self.inputs.get(v, 0) & ~self.always
            front.setdefault(m, []).append((0, 0, 0, None) if least else (row.flops_total, 1, 0, v))
        inner = self.settled[v]
        got = {}
        for m, pts in front.items():
            extra = self._bytes(m & inner)
            got.setdefault(m & ~inner, []).extend((f, k, b + extra, s) for f, k, b, s in pts)
        front = self._prune(got, limit)
        if least:
            lb[v] = min((p[2] for pts in front.values() for p in pts), default=0)
        return front

    def _prune(self, got: dict[int, list[_Point]], limit: float) -> _Front:
        out: _Front = {}
        for m, pts in got.items():
            pts = _pareto(pts, limit, self.cap)
            if len(pts) > self.max_points:  # keep the cheapest and the smallest, evenly spread
                self.thinned = True
                step = (len(pts) - 1) / (self.max_points - 1)
                pts = [pts[round(i * step)] for i in range(self.max_points)]
            if pts:
                out[m] = pts
        return out


@overload
def frontier(
    profile: MemoryProfile, budget: int | None = None, *, max_points: int = ...
) -> tuple[int, Frontier]: ...
@overload
def frontier(
    profile: MemoryProfile, budget: int | None, *, least: Literal[True], max_points: int = ...
) -> int: ...
def frontier(
    profile: MemoryProfile,
    budget: int | None = None,
    *,
    least: bool = False,
    max_points: int = 2000,
) -> Any:
    """``(bytes kept whatever is chosen, Frontier)``; with ``budget``, only plans that may fit.
    ``least=True``: only the least saved bytes any plan gets to."""
    prob = _Problem(profile, max_points)
    limit: float = float("inf")
    if budget is not None or least:
        prob.walk("", limit, least=True)
        if least:
            return prob.base + prob.lb[""]
        limit = budget - prob.base
        # a plan that fits, from coarse frontiers: no point costing more can be in the best one
        prob.max_points = 16
        rough = [p for pts in prob.walk("", limit).values() for p in pts]
        if rough:
            prob.cap = min(p[0] for p in rough)
        prob.max_points, prob.thinned = max_points, False
    front = prob.walk("", limit)
    plans = _pareto([p for pts in front.values() for p in pts], float("inf"))
    return prob.base, Frontier([(f, k, b, _names(s)) for f, k, b, s in plans], not prob.thinned)
