"""``summary``: one forward pass, one row per module call: shapes, parameters, FLOPs, time, memory."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core._buffers import state_kept
from ..core._compiled import compiled_regions, named_modules
from ..core._errors import HookscopeWarning, some_names
from ..core._inventory import has_global_hooks
from ..core._nested import call_shapes, format_shapes, iter_tensors
from ..core._scope import (
    HookScope,
    _Hook,
    acts_here,
    ancestors,
    attribute_path,
    check_model,
    get_ident,
    in_backward,
    internal_run,
    model_device,
    note_exception,
    thread_checked,
)
from ..core._sharded import fsdp1_found
from ._flops import OpCounter, data_bytes, native_rule, no_dispatch, warm_up
from ._format import parse_columns
from ._rows import CallRecord, SummaryRow, SummaryTotals, build_rows, collapse
from ._table import Summary

__all__ = ["Summary", "SummaryRow", "SummaryTotals", "summary"]


def _key(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def make_inputs(input_size: Any, dtypes: Any, device: torch.device) -> list[torch.Tensor]:
    """Random inputs (seeded, the global RNG untouched) for ``input_size`` shapes (batch included)."""
    sizes = list(input_size) if isinstance(input_size, (list, tuple, torch.Size)) else [input_size]
    if all(isinstance(d, int) for d in sizes):
        sizes = [sizes]
    shapes = []
    for s in sizes:
        if (
            not isinstance(s, (list, tuple, torch.Size))
            or not s
            or not all(isinstance(d, int) and d > 0 for d in s)
        ):
            raise ValueError(
                f"input_size: bad shape {s!r}; expected positive integers, e.g. (1, 3, 224, 224) or a list of such"
            )
        shapes.append(tuple(s))
    if dtypes is None or isinstance(dtypes, torch.dtype):
        dts = [dtypes or torch.float32] * len(shapes)
    else:
        dts = list(dtypes)
        if len(dts) != len(shapes) or not all(isinstance(d, torch.dtype) for d in dts):
            raise ValueError(
                f"dtypes: expected one torch.dtype or one per input ({len(shapes)}); got {dtypes!r}"
            )
    gen = torch.Generator().manual_seed(0)
    out = []
    for s, dt in zip(shapes, dts):
        t = (
            torch.randn(s, generator=gen)
            if dt.is_floating_point or dt.is_complex
            else torch.randint(0, 2, s, generator=gen)
        )
        out.append(t.to(device=device, dtype=dt))
    return out


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Restore what one forward can change: buffers (changed in place, e.g. BatchNorm statistics in
    train mode, or reassigned), plain attributes (a step counter), the RNG,
    and the MHA fast-path switch (turned off so sub-layers run through ``__call__``)."""
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        with torch.random.fork_rng(devices=devices), state_kept(model):
            yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fast)


class _PreHook(_Hook):
    __slots__ = ("name", "rule")

    def __init__(self, fn: Any, name: str, rule: Any) -> None:
        super().__init__(fn, "", "", "", 0)
        self.name, self.rule = name, rule

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kw: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return  # another thread's call (see acts_here)
        self.fn(module, args, kw, self.name, self.rule)


class _PostHook(_Hook):
    __slots__ = ("name",)

    def __init__(self, fn: Any, name: str) -> None:
        super().__init__(fn, "", "", "", 0)
        self.name = name

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kw: Any, output: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return  # another thread's call (see acts_here)
        self.fn(module, args, kw, output, self.name)


class _CallStack:
    """The hooks of one summary run: a stack of the module calls in progress, each recorded as a
    :class:`CallRecord`; the FLOP counter's sink follows the innermost one."""

    def __init__(self, counter: OpCounter, cuda: torch.device | None) -> None:
        self.counter, self.cuda = counter, cuda
        self.outside = counter.sink  # FLOPs of ops run outside any module call (other hooks)
        self.calls: list[CallRecord] = []
        self.stack: list[tuple[CallRecord, int]] = []
        self.guard: Any = None  # no_dispatch() while a leaf layer runs natively
        mha = getattr(torch.backends, "mha", None)
        # the user's MHA fast path setting: off during the run (so TransformerEncoderLayer's
        # sub-layers are called and shown), on again inside a MultiheadAttention run natively
        self.mha = mha if mha is not None and mha.get_fastpath_enabled() else None

    def pre(self, module: nn.Module, args: Any, kw: Any, name: str, rule: Any = None) -> None:
        if in_backward():
            return
        stack = self.stack
        parent = stack[-1] if stack else None
        c = CallRecord(name, module, len(stack), parent[1] if parent else -1)
        c.shapes = call_shapes(args, kw)
        if parent is not None:
            parent[0].children += 1
        stack.append((c, len(self.calls)))
        self.calls.append(c)
        self.counter.sink = c
        if self.cuda:
            c.ev = torch.cuda.Event(enable_timing=True)
            c.ev.record()
        if rule is not None and self.guard is None and rule.accepts(args, kw):
            c.rule = rule  # counted from the shapes in post(), same formula as the dispatcher's
            self.guard = no_dispatch()
            if rule.fastpath and self.mha is not None:
                self.mha.set_fastpath_enabled(True)
        c.t0 = time.perf_counter()

    def post(self, module: nn.Module, args: Any, kw: Any, output: Any, name: str) -> None:
        t1 = time.perf_counter()
        stack = self.stack
        if not stack or in_backward() or stack[-1][0].module is not module:
            return
        c = stack.pop()[0]
        self.counter.sink = stack[-1][0] if stack else self.outside
        c.time = (t1 - c.t0) * 1e3
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            c.ev = (c.ev, end)
        if c.rule is not None:
            self.guard = None  # the dispatch mode sees operators again
            if c.rule.fastpath and self.mha is not None:
                self.mha.set_fastpath_enabled(False)
            if output is not None:  # None: the layer raised (these layers return a value)
                n = c.rule.flops(module, args, kw, output)
                c.flops += n
                self.counter.total_flops += n
                self.counter._track(output)  # its new tensors, as the dispatcher would
        if output.__class__ is torch.Tensor:  # the common case
            c.out_shapes = list(output.shape)
            c.out_bytes = output.numel() * output.element_size()
            c.new_bytes = 0 if _aliases_input(output, args, kw) else c.out_bytes
            return
        if output is None and sys.exc_info()[1] is not None:
            note_exception(name, module, args, kw)  # name the failing layer in the error
            return
        seen: set[int] = set()
        for p, t in iter_tensors(output):
            c.out_shapes[_key(p)] = list(t.shape)
            if id(t) not in seen:
                seen.add(id(t))
                n = t.numel() * t.element_size()
                c.out_bytes += n
                if not _aliases_input(t, args, kw):
                    c.new_bytes += n

    def hooks(self, name: str, module: nn.Module, rule: Any) -> tuple[_Hook, _Hook]:
        """The pre- and post-forward hooks of ``module`` (direct calls: no partial, no kwargs)."""
        return _PreHook(self.pre, name, rule), _PostHook(self.post, name)

    def finish(self) -> list[CallRecord]:
        """The calls, with GPU times read from their events (after the final synchronize)."""
        for c in self.calls:
            if isinstance(c.ev, tuple):
                c.time = c.ev[0].elapsed_time(c.ev[1])
        if self.calls:
            self.calls[0].flops += self.outside.flops
        return self.calls


def _eager(model: nn.Module) -> Any:
    """For a model with compiled parts, ``torch.compiler.set_stance("force_eager")`` (torch 2.6+)."""
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None or not compiled_regions(model):
        return contextlib.nullcontext()
    return stance("force_eager")


def summary(
    model: nn.Module,
    *inputs: Any,
    input_size: Any = None,
    dtypes: Any = None,
    depth: int | None = None,
    columns: str | Sequence[str] | None = None,
    **kwargs: Any,
) -> Summary:
    """Run ``model(*inputs, **kwargs)`` once, under ``torch.no_grad()``, and describe every module call.

    One :class:`SummaryRow` per call, in call order (a module called twice gets two rows, ``#1`` and
    ``#2``): dotted name, type, input shapes (positional and keyword), output shapes (nested outputs
    too), parameters and trainable parameters (a shared/tied parameter counts once in the totals and
    is marked ``*`` where it repeats), forward FLOPs of the operators the call ran itself (counted at
    the dispatcher with ``FlopCounterMode``'s formulas; leaf layers of known built-in types, such
    as ``Conv2d``, ``Linear``, ``BatchNorm2d``, ``MultiheadAttention``, run with the dispatcher's
    Python mode off and are counted from their shapes with the same formulas, which is what keeps
    ``summary`` as fast as torchinfo; rows sum to the total), inclusive time and
    output bytes. Totals: parameters, FLOPs, parameter bytes, activation bytes, peak memory (CUDA:
    ``max_memory_allocated`` over the forward, after resetting the peak counter; CPU: the peak of
    bytes of tensors created by the forward and alive at once, tracked at the dispatcher).

    The model is left as found: mode, device, ``requires_grad``, buffers, RNG state, no hooks. The
    MHA fast path is off during the run so attention sub-layers are shown and counted. An
    exception inside the model is re-raised with a note naming the layer and the shapes it got.

    Args:
        model: any ``nn.Module``.
        inputs: the model's positional inputs (tensors or anything it takes).
        input_size: instead of ``inputs``: a shape such as ``(1, 3, 224, 224)``, or a list of
            shapes for several inputs; random tensors are made on the model's device.
        dtypes: with ``input_size``: one dtype for every input, or one per input (default
            ``float32``; an integer dtype gives random 0/1 values).
        depth: fold rows deeper than ``depth`` into their ancestor at that depth (totals
            unchanged).
        columns: the table's columns: ``"all"``, or some of ``type, input, output, params,
            trainable, flops, time, bytes``.
        kwargs: keyword inputs of the model (every keyword other than the four above goes to it).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
        >>> s = hs.summary(net, torch.zeros(2, 8))
        >>> [(r.label, r.params, r.flops) for r in s.rows]
        [('<root>', 36, 0), ('0', 36, 128), ('1', 0, 0)]
        >>> s.totals.flops, s.rows[1].output_shapes
        (128, [2, 4])
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        check_model(model)
        fsdp1 = fsdp1_found(model)
        if fsdp1:
            warnings.warn(
                f"the model is sharded by FSDP1 FullyShardedDataParallel ({some_names(fsdp1)}): "
                "its parameters are this rank's flat shards, so the parameter counts are this "
                "rank's (padded), not the model's. Summarize the model before wrapping it, or shard with FSDP2 "
                "(fully_shard: DTensor parameters are counted whole)",
                HookscopeWarning,
                stacklevel=2,
            )
        if depth is not None and (not isinstance(depth, int) or depth < 0):
            raise ValueError(f"depth must be a non-negative int or None; got {depth!r}")
        cols = parse_columns(columns)
        device = model_device(model)
        if input_size is not None:
            if inputs:
                raise ValueError("give the inputs or input_size, not both")
            inputs = tuple(make_inputs(input_size, dtypes, device))
        elif dtypes is not None:
            raise ValueError("dtypes applies to input_size; give input_size too (or pass tensors)")
        if not inputs and not kwargs:
            raise ValueError(
                "summary needs an input: summary(model, x), summary(model, input_ids=ids) or input_size=(1, 3, 224, 224)"
            )

        warm_up()
        known = [
            *model.parameters(),
            *model.buffers(),
            *(t for _, t in iter_tensors((inputs, kwargs))),
        ]
        rec = _CallStack(OpCounter(known), next((t.device for t in known if t.is_cuda), None))
        dev = rec.cuda or device
        # leaf layers that may run natively, decided before our own hooks are on them
        rules = {} if has_global_hooks() else {id(m): native_rule(m) for m in model.modules()}
        with HookScope("summary") as scope:
            hooked = dict(named_modules(model))
            for name, module in hooked.items():
                pre, post = rec.hooks(name, module, rules.get(id(module)))
                scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
                scope.add_forward(module, post, layer=name, with_kwargs=True, always_call=True)
            scope.track(model, hooked)  # (a module the forward builds or replaces: said after)
            with _state_kept(model), torch.no_grad():
                before = 0
                if rec.cuda:
                    torch.cuda.synchronize(dev)
                    before = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                try:
                    # a summary describes the eager modules (per-call shapes, FLOPs, times): compiled
                    # parts run eagerly here, every module being hooked anyway
                    with rec.counter, _eager(model):
                        model(*inputs, **kwargs)
                finally:
                    rec.guard = None
                if rec.cuda:
                    torch.cuda.synchronize(dev)
                wall = (time.perf_counter() - t0) * 1e3
                peak = (
                    torch.cuda.max_memory_allocated(dev) - before
                    if rec.cuda
                    else rec.counter.peak_bytes
                )
        if rec.counter.uncounted and not rec.cuda:
            _say_uncounted(rec.counter.uncounted)
        calls = rec.finish()
        rows = build_rows(calls)
        params = {id(p): p for p in model.parameters()}
        totals = SummaryTotals(
            params=sum(p.numel() for p in params.values()),
            trainable=sum(p.numel() for p in params.values() if p.requires_grad),
            flops=rec.counter.total_flops,
            param_bytes=sum(data_bytes(p) for p in params.values()),
            buffer_bytes=sum(data_bytes(b) for b in model.buffers()),  # (sparse: what it holds)
            activation_bytes=sum(c.new_bytes for c in calls if c.children == 0),
            peak_memory_bytes=int(peak),
            peak_memory_measure=(
                "CUDA max_memory_allocated above what was allocated before"
                if rec.cuda
                else "CPU: tensors the forward created, alive at once"
            ),
            time_ms=wall,
            device=str(dev),
        )
        ran = {id(c.module) for c in calls}
        containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
        # a module the forward built or replaced ran without the hooks: not "never called"
        lost = scope.replaced_all()
        now = dict(named_modules(model))
        lost.update(
            (n, f"{attribute_path(n)} was added to the model (a {type(m).__name__})")
            for n, m in now.items()
            if n not in hooked and n not in lost
        )
        lost.update(
            (n, f"the hooks on {attribute_path(n)} were removed by hs.remove_hooks")
            for n in sorted(scope.stripped)
            if n not in lost
        )
        lost = {n: v for n, v in lost.items() if n in now and id(now[n]) not in ran}
        if lost:
            first = next(iter(lost))
            warnings.warn(
                f"summary: layer(s) {some_names(list(lost))} changed in the model during its "
                f"forward ({lost[first]}), so they ran without the summary's hooks: they have "
                "no row, and their FLOPs and time are counted in the row of the layer that "
                f"called them; run the model once before summary (a forward that builds "
                f"{attribute_path(first)} builds it then), or make the change before",
                HookscopeWarning,
                stacklevel=2,
            )
        # calls a worker thread the forward started made: the hooks and the FLOP counter act in
        # the calling thread only, so those calls are in no row and no total
        away = {n: t for n, t in scope.elsewhere.items() if n in now}
        if away:
            outer = [n for n in away if not any(p in away for p in ancestors(n))]
            warnings.warn(
                f"summary: layer(s) {some_names(outer)} ran in thread {away[outer[0]]!r}, which "
                "the model's forward started and waited on: the summary's hooks and FLOP counter "
                "act only in the thread that called summary (docs/guide/core.md, Threads), so "
                "those calls have no row and their FLOPs, time and memory are in no total (the "
                "totals are short by them); run those layers in the forward's own thread",
                HookscopeWarning,
                stacklevel=2,
            )
        never = [
            n
            for n, m in now.items()
            if id(m) not in ran
            and not isinstance(m, containers)
            and n not in lost
            and n not in away
        ]
        if depth is not None:
            rows = collapse(rows, depth)
        shown = format_shapes(call_shapes(inputs, kwargs))
        return Summary(type(model).__name__, shown, rows, totals, cols, never)


def _say_uncounted(uncounted: dict[str | None, str]) -> None:
    """Warn that the CPU peak leaves out tensors whose bytes cannot be read (``{layer: kind}``,
    ``None``: created outside any module call)."""
    layers = [n if n is not None else "<outside any layer>" for n in uncounted]
    first = next(iter(uncounted))
    warnings.warn(
        f"summary: layer(s) {some_names([n or '<root>' for n in layers])} created tensors whose "
        f"bytes cannot be read ({uncounted[first]} in {first or '<root>'!r}; not a strided, "
        "sparse or nested tensor, nor a wrapper subclass of those), so the peak memory leaves "
        "them out: it is under-reported by their size. Convert them to a strided tensor in the "
        "forward (.to_dense()) while summarizing, or measure the peak on a CUDA device "
        "(torch.cuda.max_memory_allocated counts every allocation)",
        HookscopeWarning,
        stacklevel=3,
    )


def _aliases_input(t: torch.Tensor, args: Any, kw: Any) -> bool:
    """Whether output ``t`` shares memory with one of the call's input tensors (an in-place
    op's result, a view such as ``nn.Flatten``'s): no new activation (the inputs are alive
    during the call, so their storages cannot have been reused)."""
    if t.layout != torch.strided or t.is_nested:
        return False
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own
        return False
    if ptr == 0:
        return False
    for _, x in iter_tensors((args, kw)):
        if x.layout == torch.strided and not x.is_nested:
            try:
                if x.untyped_storage().data_ptr() == ptr:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
    return False
