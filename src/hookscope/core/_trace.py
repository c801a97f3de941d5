"""``trace``: print every layer call as it happens (verbose execution)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn as nn

from ._nested import Shapes, call_shapes, first_tensor, format_shapes, shapes
from ._scope import HookScope, check_model, note_exception, warn_lost
from ._select import resolve

__all__ = ["Trace", "TraceEvent", "trace"]


def _fit(text: str, width: int) -> str:
    """``text`` in ``width`` characters: a longer one keeps its end (the most specific part)."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


@dataclass
class TraceEvent:
    """One traced call: what :func:`trace` printed, as data.

    ``input_shapes`` and ``output_shapes`` are in hookscope's one form of shapes (the same as
    :class:`SummaryRow`'s): one tensor's shape as a list (``[2, 4]``); several tensors as
    ``{path: shape}`` (positional paths ``"0"``, keyword names, paths into the output such as
    ``"logits"``). ``raised`` is ``True`` for a call that ended with an exception.
    """

    layer: str
    index: int
    type: str
    depth: int
    input_shapes: Shapes
    output_shapes: Shapes
    dtype: str
    device: str
    ms: float
    raised: bool = False

    def format(self, width: int = 28, type_width: int = 16) -> str:
        """The printed line: columns ``width`` (name, indented by depth) and ``type_width`` wide;
        longer names and types are shortened from the left with ``…``."""
        name = _fit("  " * self.depth + (self.layer or "<root>"), width)
        if self.raised:
            return f"{name:<{width}} {self.index:>3d} {_fit(self.type, type_width):<{type_width}}  raised"
        return (
            f"{name:<{width}} {self.index:>3d} {_fit(self.type, type_width):<{type_width}} "
            f"{self.ms:>9.3f}  {self.dtype:<8} {self.device:<6} "
            f"{format_shapes(self.input_shapes)} -> {format_shapes(self.output_shapes)}"
        )


def header(width: int = 28, type_width: int = 16) -> str:
    """The column titles :func:`trace` prints above its first line."""
    return (
        f"{'layer':<{width}} {'#':>3} {'type':<{type_width}} {'ms':>9}  {'dtype':<8} {'device':<6} "
        "input -> output shapes"
    )


class Trace(HookScope):
    """The scope returned by :func:`trace`; ``.events`` holds every call as a :class:`TraceEvent`,
    in the order the calls started (a container before its children)."""

    def __init__(self, owner: str = "trace") -> None:
        super().__init__(owner)
        self.events: list[TraceEvent] = []


class _Lines:
    """The printed lines, in the order their calls started: each call takes a slot when it starts
    (:meth:`open`), fills it when it returns (:meth:`fill`), and a slot is printed (and added to
    the scope's events) once every slot before it is filled."""

    def __init__(
        self, scope: Trace, file: TextIO | None, quiet: bool, width: int, type_width: int
    ) -> None:
        self.scope, self.file, self.quiet = scope, file, quiet
        self.width, self.type_width = width, type_width
        self.slots: list[TraceEvent | None] = []
        self.printed = 0  # slots printed so far
        self.header_done = False

    def open(self) -> int:
        self.slots.append(None)
        return len(self.slots) - 1

    def fill(self, slot: int, event: TraceEvent) -> None:
        self.slots[slot] = event
        slots = self.slots
        while self.printed < len(slots):
            ev = slots[self.printed]
            if ev is None:
                return
            self.printed += 1
            self._emit(ev)
        slots.clear()
        self.printed = 0

    def finish(self) -> None:
        """Print the calls that returned after one that never did (hooks removed mid-call)."""
        for ev in self.slots[self.printed :]:
            if ev is not None:
                self._emit(ev)
        self.slots.clear()
        self.printed = 0

    def _emit(self, ev: TraceEvent) -> None:
        self.scope.events.append(ev)
        if self.quiet:
            return
        out = self.file or sys.stdout
        if not self.header_done:
            self.header_done = True
            print(header(self.width, self.type_width), file=out, flush=True)
        print(ev.format(self.width, self.type_width), file=out, flush=True)


def trace(
    model: nn.Module,
    layers: Any = None,
    *,
    file: TextIO | None = None,
    sync: bool = False,
    quiet: bool = False,
) -> Trace:
    """Print each layer call: name (indented by nesting), call index, type, inclusive time,
    dtype, device, input and output shapes, under a header line.

    Lines come in the order the calls *started*, so a container is printed above its children,
    as a tree. A line is printed as soon as its call and every call that started before it have
    returned: a traced leaf layer prints at once, and a container's line (with the lines of its
    children) when the container returns. A call that raised is printed with ``raised``.
    Names longer than the name column are shortened from the left with ``…``
    (``.events`` keeps them whole).

    An exception inside the model gets a note naming the innermost layer and the shapes it got.

    Args:
        model: any ``nn.Module``.
        layers: what to print (see :func:`find`); default: every module.
        file: where lines go (default: ``sys.stdout``).
        sync: synchronise CUDA around each call for exact GPU timings (off by default: no host
            sync in hooks).
        quiet: print nothing; the calls are still in ``.events``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, io
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> out = io.StringIO()
        >>> with hs.trace(net, file=out) as tr:
        ...     _ = net(torch.zeros(4, 2))
        >>> [line.split()[0] for line in out.getvalue().splitlines()]
        ['layer', '<root>', '0', '1']
        >>> tr.events[1].input_shapes, tr.events[1].output_shapes
        ([4, 2], [4, 3])
    """
    check_model(model)
    if file is not None and not callable(getattr(file, "write", None)):
        raise TypeError(
            f"trace: file must be an open text stream (e.g. open('trace.txt', 'w'), io.StringIO(), "
            f"sys.stderr); got {type(file).__name__}: {file!r}"
        )
    named = resolve(model, layers)
    scope = Trace("trace")
    depth_of = {name: (0 if name == "" else name.count(".") + 1) for name in named}
    if "" not in named:
        shallow = min(depth_of.values(), default=0)
        depth_of = {k: v - shallow for k, v in depth_of.items()}
    counts: dict[str, int] = {}
    width = min(60, max((len(n or "<root>") + 2 * depth_of[n] for n in named), default=10))
    width = max(width, len("layer"))
    type_width = min(24, max((len(type(m).__name__) for m in named.values()), default=8))
    lines = _Lines(scope, file, quiet, width, type_width)

    for name, module in named.items():
        starts: list[tuple[float, int]] = []

        def pre(
            module: nn.Module, args: Any, kwargs: Any, starts: list[tuple[float, int]] = starts
        ) -> None:
            t = first_tensor((args, kwargs))
            if sync and t is not None and t.is_cuda:
                torch.cuda.synchronize(t.device)
            starts.append((time.perf_counter(), lines.open()))

        def post(
            module: nn.Module,
            args: Any,
            kwargs: Any,
            output: Any,
            name: str = name,
            starts: list[tuple[float, int]] = starts,
        ) -> None:
            if not starts:
                return
            start, slot = starts.pop()
            index = counts.get(name, 0)
            counts[name] = index + 1
            raised = sys.exc_info()[1] is not None and output is None
            if raised:
                note_exception(name, module, args, kwargs)
            t = first_tensor(output)
            if sync and t is not None and t.is_cuda:
                torch.cuda.synchronize(t.device)
            ms = (time.perf_counter() - start) * 1e3
            event = TraceEvent(
                layer=name,
                index=index,
                type=type(module).__name__,
                depth=depth_of[name],
                input_shapes=call_shapes(args, kwargs),
                output_shapes=shapes(output),
                dtype=str(t.dtype).replace("torch.", "") if t is not None else "-",
                device=str(t.device) if t is not None else "-",
                ms=ms,
                raised=raised,
            )
            lines.fill(slot, event)

        scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
        scope.add_forward(module, post, layer=name, with_kwargs=True, always_call=True)

    scope.on_remove(lines.finish)  # calls that never returned (hooks removed mid-call)
    # a layer replaced while open, or hooks hs.remove_hooks took: its calls are missing (warned)
    # (names only: the scope holds no module, so the model is freed by reference counting)
    scope.track(model, named)
    names = tuple(named)
    scope.watch_unrouted(model, names, "traced")
    scope.on_remove(
        lambda: warn_lost(scope, names, "trace", "traced", {n: counts.get(n, 0) for n in names})
    )
    return scope
