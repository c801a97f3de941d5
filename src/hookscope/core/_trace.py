"""``trace``: print every layer call as it happens (verbose execution)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn as nn

from ._nested import first_tensor, iter_tensors
from ._scope import HookScope, check_model, note_exception
from ._select import resolve

__all__ = ["Trace", "TraceEvent", "trace"]


def _shape(obj: Any) -> str:
    shapes = [list(t.shape) for _, t in iter_tensors(obj)]
    if not shapes:
        return "-"
    if len(shapes) == 1 and isinstance(obj, torch.Tensor):
        return str(shapes[0])
    return "(" + ", ".join(str(s) for s in shapes) + ")"


@dataclass
class TraceEvent:
    """One traced call: what :func:`trace` printed, as data."""

    layer: str
    index: int
    type: str
    depth: int
    input_shapes: str
    output_shapes: str
    dtype: str
    device: str
    ms: float

    def format(self, width: int = 28, type_width: int = 16) -> str:
        name = ("  " * self.depth + (self.layer or "<root>")).ljust(width)
        return (
            f"{name} #{self.index:<2d} {self.type:<{type_width}s} {self.input_shapes} -> {self.output_shapes}"
            f"  {self.dtype} {self.device}  {self.ms:.3f} ms"
        )


class Trace(HookScope):
    """The scope returned by :func:`trace`; ``.events`` holds every call as a :class:`TraceEvent`."""

    def __init__(self, owner: str = "trace") -> None:
        super().__init__(owner)
        self.events: list[TraceEvent] = []


def trace(
    model: nn.Module,
    layers: Any = None,
    *,
    file: TextIO | None = None,
    sync: bool = False,
    quiet: bool = False,
) -> Trace:
    """Print each layer call as it completes: name, call index, type, input and output shapes,
    dtype, device and inclusive time. Indentation shows nesting.

    ``layers`` selects what to print (default: every module). ``sync=True`` synchronises CUDA
    around each call for exact GPU timings (off by default: no host sync in hooks). An exception
    inside the model gets a note naming the innermost layer and the shapes it got.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, io
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> out = io.StringIO()
        >>> with hs.trace(net, file=out):
        ...     _ = net(torch.zeros(4, 2))
        >>> [line.split()[0] for line in out.getvalue().splitlines()]
        ['0', '1', '<root>']
    """
    check_model(model)
    named = resolve(model, layers)
    stream = file
    scope = Trace("trace")
    depth_of = {name: (0 if name == "" else name.count(".") + 1) for name in named}
    if "" not in named:
        shallow = min(depth_of.values(), default=0)
        depth_of = {k: v - shallow for k, v in depth_of.items()}
    counts: dict[str, int] = {}
    width = min(40, max((len(n) + 2 * depth_of[n] for n in named), default=10) + 2)
    type_width = min(24, max((len(type(m).__name__) for m in named.values()), default=8))

    for name, module in named.items():
        starts: list[float] = []

        def pre(module: nn.Module, args: Any, kwargs: Any, starts: list[float] = starts) -> None:
            t = first_tensor((args, kwargs))
            if sync and t is not None and t.is_cuda:
                torch.cuda.synchronize(t.device)
            starts.append(time.perf_counter())

        def post(
            module: nn.Module,
            args: Any,
            kwargs: Any,
            output: Any,
            name: str = name,
            starts: list[float] = starts,
        ) -> None:
            if not starts:
                return
            start = starts.pop()
            if sys.exc_info()[1] is not None and output is None:
                note_exception(name, module, args, kwargs)
                return
            t = first_tensor(output)
            if sync and t is not None and t.is_cuda:
                torch.cuda.synchronize(t.device)
            ms = (time.perf_counter() - start) * 1e3
            index = counts.get(name, 0)
            counts[name] = index + 1
            ev = TraceEvent(
                layer=name,
                index=index,
                type=type(module).__name__,
                depth=depth_of[name],
                input_shapes=_shape(args[0] if len(args) == 1 and not kwargs else (args, kwargs)),
                output_shapes=_shape(output),
                dtype=str(t.dtype).replace("torch.", "") if t is not None else "-",
                device=str(t.device) if t is not None else "-",
                ms=ms,
            )
            scope.events.append(ev)
            if not quiet:
                print(
                    ev.format(width, type_width),
                    file=stream if stream is not None else sys.stdout,
                    flush=True,
                )

        scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
        scope.add_forward(module, post, layer=name, with_kwargs=True, always_call=True)
    return scope
