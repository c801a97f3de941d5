"""The rows of a model summary: :class:`SummaryRow`, :class:`SummaryTotals`, and how the calls
recorded during the forward become rows (shared parameters, call indices, depth folding)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..core._nested import Shapes

__all__ = ["CallRecord", "SummaryRow", "SummaryTotals", "build_rows", "collapse"]


@dataclass
class SummaryRow:
    """One call of one module, in call order (a module called 3 times has 3 rows).

    Shapes are in hookscope's one form (the same as :class:`TraceEvent`'s): a single tensor's
    shape as a list (``[2, 4]``); several tensors as ``{path: shape}``, where ``input_shapes``
    keys are positional paths (``"0"``, ``"1.h"``) and keyword names (``"attention_mask"``) and
    ``output_shapes`` keys are paths into the output (``"0"``, ``"last_hidden_state"``).

    Attributes:
        name: the module's dotted name (``""`` for the model itself; see :attr:`label`).
        type: the module's class name.
        depth: nesting depth (0 for the model).
        call: which call of this module the row is (0 for its first).
        calls: how many times the module was called in the forward.
        input_shapes: shapes of the positional and keyword inputs.
        output_shapes: shapes of the output (nested outputs too).
        params: parameters of the module and its children.
        trainable: of those, the ones that require a gradient.
        shared_params: of ``params``, those already counted by an earlier row that is not an
            ancestor (tied weights, a repeated call): totals count them once.
        flops: FLOPs of the operators this call ran itself, not inside a child row (rows sum to
            the total).
        time_ms: wall time of the call, children included.
        output_bytes: bytes of the output's tensors.
        leaf: no child row below it (an innermost layer, or folded by ``depth=``).
    """

    name: str
    type: str
    depth: int
    call: int
    calls: int
    input_shapes: Shapes
    output_shapes: Shapes
    params: int
    trainable: int
    shared_params: int
    flops: int
    time_ms: float
    output_bytes: int
    leaf: bool

    @property
    def label(self) -> str:
        """The name as shown: ``<root>`` for the model, ``relu#2`` for a module's second call."""
        base = self.name or "<root>"
        return f"{base}#{self.call + 1}" if self.calls > 1 else base


@dataclass
class SummaryTotals:
    """Totals of a summary. Parameters are counted once each, however many modules share them.

    Attributes:
        params: parameters of the model.
        trainable: of those, the ones that require a gradient.
        flops: forward FLOPs (the sum of the rows).
        param_bytes: bytes of the parameters.
        buffer_bytes: bytes of the buffers.
        activation_bytes: bytes of the outputs of the innermost rows, each output sharing memory
            with its call's input (an in-place op's result, a view) not counted again.
        peak_memory_bytes: the extra memory the forward needed at its peak.
        peak_memory_measure: how ``peak_memory_bytes`` was measured (CUDA allocator or CPU
            tensor tracking).
        time_ms: wall time of the forward.
        device: the device the forward ran on.
    """

    params: int
    trainable: int
    flops: int
    param_bytes: int
    buffer_bytes: int
    activation_bytes: int
    peak_memory_bytes: int
    peak_memory_measure: str
    time_ms: float
    device: str


class CallRecord:
    """A module call being recorded (becomes a :class:`SummaryRow`)."""

    __slots__ = (
        "children",
        "depth",
        "ev",
        "flops",
        "module",
        "name",
        "new_bytes",
        "out_bytes",
        "out_shapes",
        "parent",
        "rule",
        "shapes",
        "t0",
        "time",
    )

    def __init__(self, name: str, module: nn.Module, depth: int, parent: int) -> None:
        self.name, self.module, self.depth, self.parent = name, module, depth, parent
        self.flops = 0
        self.children = 0
        self.time = 0.0
        self.t0 = 0.0
        self.ev: Any = None
        self.shapes: Shapes = {}
        self.out_shapes: Shapes = {}
        self.out_bytes = 0
        self.new_bytes = 0  # of out_bytes, those not sharing memory with an input (see post)
        self.rule: Any = None  # the FLOP rule of a leaf layer run with the dispatch mode off


def _params(module: nn.Module, memo: dict[int, list[nn.Parameter]]) -> list[nn.Parameter]:
    """``list(module.parameters())`` (each once), memoised over the tree: O(params x depth)."""
    got = memo.get(id(module))
    if got is None:
        seen = {id(p): p for p in module._parameters.values() if p is not None}
        for child in module._modules.values():
            if child is not None:
                for p in _params(child, memo):
                    seen.setdefault(id(p), p)
        got = memo[id(module)] = list(seen.values())
    return got


def build_rows(calls: list[CallRecord]) -> list[SummaryRow]:
    """One row per recorded call: call index among the module's calls, parameter counts, and the
    parameters already counted by an earlier row that is not an ancestor (tied, shared, reused)."""
    per_module: dict[int, int] = {}
    for c in calls:
        per_module[id(c.module)] = per_module.get(id(c.module), 0) + 1
    if len(per_module) == len(calls):
        sizes_ = _tree_sizes([c.module for c in calls])
        if sizes_ is not None:  # nothing shared, nothing called twice: every shared count is 0
            return [_row(c, 0, 1, sizes_[id(c.module)], 0) for c in calls]
    index: dict[int, int] = {}
    holders: dict[int, list[int]] = {}  # parameter id -> rows that counted it
    memo: dict[int, list[nn.Parameter]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    rows = []
    for i, c in enumerate(calls):
        mid = id(c.module)
        k = index[mid] = index.get(mid, -1) + 1
        ps = _params(c.module, memo)
        if mid not in sizes:
            sizes[mid] = (sum(p.numel() for p in ps), sum(p.numel() for p in ps if p.requires_grad))
        ancestors = set()
        a = c.parent
        while a >= 0:
            ancestors.add(a)
            a = calls[a].parent
        shared = 0
        for p in ps:
            hs = holders.setdefault(id(p), [])
            if any(h not in ancestors for h in hs):
                shared += p.numel()
            hs.append(i)
        rows.append(_row(c, k, per_module[mid], sizes[mid], shared))
    return rows


def _row(c: CallRecord, call: int, calls: int, size: tuple[int, int], shared: int) -> SummaryRow:
    return SummaryRow(
        name=c.name,
        type=type(c.module).__name__,
        depth=c.depth,
        call=call,
        calls=calls,
        input_shapes=c.shapes,
        output_shapes=c.out_shapes,
        params=size[0],
        trainable=size[1],
        shared_params=shared,
        flops=c.flops,
        time_ms=c.time,
        output_bytes=c.out_bytes,
        leaf=c.children == 0,
    )


def _tree_sizes(modules: list[nn.Module]) -> dict[int, tuple[int, int]] | None:
    """``(params, trainable)`` of each module and its descendants, summed bottom-up in one walk;
    None if some module or parameter is reachable twice (shared: the slow, exact path counts it)."""
    sizes: dict[int, tuple[int, int]] = {}
    seen_params: set[int] = set()

    def walk(m: nn.Module) -> tuple[int, int] | None:
        n = t = 0
        for p in m._parameters.values():
            if p is None:
                continue
            if id(p) in seen_params:
                return None
            seen_params.add(id(p))
            n += p.numel()
            if p.requires_grad:
                t += p.numel()
        for child in m._modules.values():
            if child is None:
                continue
            if id(child) in sizes:
                return None
            got = walk(child)
            if got is None:
                return None
            n, t = n + got[0], t + got[1]
        sizes[id(m)] = (n, t)
        return n, t

    for m in modules:
        if id(m) not in sizes and walk(m) is None:
            return None
    return sizes


def collapse(rows: list[SummaryRow], depth: int) -> list[SummaryRow]:
    """Fold rows deeper than ``depth`` into their ancestor at ``depth`` (FLOPs added to it)."""
    out: list[SummaryRow] = []
    keeper: SummaryRow | None = None
    for r in rows:
        if r.depth <= depth:
            keeper = dataclasses.replace(r, leaf=r.leaf or r.depth == depth)
            out.append(keeper)
        elif keeper is not None:
            keeper.flops += r.flops
    return out
