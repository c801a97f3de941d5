"""``capture``: record layer outputs, inputs and gradients, every call, in order."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.nn as nn

from ._call import Call, Inputs, _GradSlots, _nograd_reason
from ._errors import HookscopeWarning, LayerNotFoundError, LayerNotRunError
from ._nested import iter_tensors, map_tensors, object_copier
from ._recompute import REENTRANT_HINT, Recomputes
from ._scope import (
    _GONE,
    HookScope,
    _Hook,
    acts_here,
    attribute_path,
    check_model,
    get_ident,
    graph_task_id,
    identity_views,
    in_backward,
    quiet,
    ran_in_copy,
    thread_checked,
    warn_once,
)
from ._select import resolve, suggest
from ._sequence import SequenceError, TokenSequence, TokenTracker, assemble
from ._sharded import warn_tp_shards
from ._transfer import device_arg, move, ready

__all__ = ["Call", "Capture", "Inputs", "TokenSequence", "capture"]

_NEVER_RAN_HINT = (
    "it was never called through module(...) while the scope was open. PyTorch runs hooks only "
    "through __call__: a parent that calls child.forward(...) directly skips them "
    "(e.g. nn.MultiheadAttention.out_proj), and branches not taken for this input never run. "
    "If the model runs through torch.compile, give hookscope the compiled model (the object you "
    "call), not the module it wraps: a compiled graph hookscope was not given ignores its hooks. "
    "A scope acts only on the calls of the thread that created it: a call from another thread "
    "is not recorded"
)


class _Recorder:
    """Per-scope recording logic shared by :class:`Capture` and :class:`FeatureExtractor`."""

    def __init__(
        self,
        *,
        inputs: bool,
        grads: bool,
        detach: bool,
        clone: bool,
        to: torch.device | None,
        keep: str,
    ) -> None:
        self.want_inputs, self.want_grads = inputs, grads
        self.detach, self.clone, self.to, self.keep = detach, clone, to, keep
        # per layer: Call objects, or (index, tensor, version) tuples from the fast path, turned
        # into Calls when read (see materialize)
        self.calls: dict[str, list[Any]] = {}
        # itertools.count: next() is atomic, so DataParallel replicas running the shared hooks in
        # threads get unique call indices (docs/pitfalls.md §17); list.append is atomic too
        self.counts: dict[str, itertools.count[int]] = {}
        self.hooks: list[_OutputHook] = []
        self.warned: set[str] = set()
        # the common case (a plain tensor, detached, no device move, no gradient) takes the
        # lean path in _OutputHook: one detach (and one clone), one tuple, one append
        self.simple = detach and to is None and not grads
        # calls made inside reentrant checkpoints, whose gradients come with the recompute
        self.recomputes = Recomputes()

    def materialize(self, name: str) -> list[Call]:
        """The recorded calls of ``name`` as :class:`Call` objects."""
        entries = self.calls.get(name)
        if not entries:
            return []
        for i, e in enumerate(entries):
            if e.__class__ is tuple:
                index, t, version = e
                call = Call(name, index)
                call._output = t
                call._versions = [(t, version)] if version is not None else None
                entries[i] = call
        return entries

    def clear(self) -> None:
        for entries in self.calls.values():
            entries.clear()
        self.counts.clear()
        for h in self.hooks:
            h.counter = itertools.count()

    def store(
        self,
        value: Any,
        versions: list[tuple[torch.Tensor, int]] | None,
        final: bool = False,
    ) -> Any:
        """What is kept of ``value``: detached (unless ``detach=False``) and copied (unless
        ``clone=False``; a copy to another device with ``to=`` is already a copy). Zero-copy
        tensors are listed in ``versions`` with their version counter, so a later in-place change
        is reported when the value is read. ``final``: the forward pass ends right after this
        call (``stop=True``), so nothing can change the value: no copy is needed."""
        detach, clone, to = self.detach, self.clone and not final, self.to

        def one(t: torch.Tensor) -> Any:
            if detach:
                t = t.detach()
            if to is not None and t.device != to:
                return move(t, to)  # a copy on the device's stream: ordered before later writes
            if clone:
                return t.clone()
            if versions is not None and not t.is_inference():
                versions.append((t, t._version))
            return t

        if value.__class__ is torch.Tensor:
            return one(value)
        # the objects among the value (a ``Box(h)`` a module returns) copied, their tensors kept
        # as the others: the model changing such an object after the call (``box.h = ...``)
        # changed the captured value
        return map_tensors(one, value, object_copier(one, who="hookscope"))

    def new_call(self, name: str) -> Call:
        counter = self.counts.get(name)
        if counter is None:
            counter = self.counts.setdefault(name, itertools.count())
        call = Call(name, next(counter))
        entries = self.calls.setdefault(name, [])
        if self.keep == "last" and entries:
            entries[0] = call
        else:
            entries.append(call)
        return call

    def attach_grads(
        self, scope: HookScope, name: str, value: Any, what: str, note: Any = None
    ) -> tuple[_GradSlots, Any]:
        """Register gradient hooks on the tensors of ``value``; return the slots. ``note``:
        ``(key, call)`` to pair with the recompute when this runs in a reentrant checkpoint."""
        leaves = list(iter_tensors(value))
        needs = [t.requires_grad for _, t in leaves]
        reason = None if any(needs) else _nograd_reason()
        if (
            reason is not None
            and note is not None
            and self.recomputes.note(note[0], value, note[1])
        ):
            reason = REENTRANT_HINT  # the gradient hooks go on the recompute (docs/pitfalls.md §27)
        elif reason is not None and not torch.is_grad_enabled():
            warn_once(
                self.warned,
                "nograd",
                f"capture(grads=True): {reason}, so no gradient will be recorded for {name!r}",
            )
        slots = _GradSlots(len(leaves), reason)
        for i, (_, t) in enumerate(leaves):
            if t.requires_grad:
                scope.add_activation_grad_hook(t, slots.hook(i, self.to), layer=name)
        return slots, value


class _OutputHook(_Hook):
    """Forward hook recording a layer's outputs. The common case (a tensor output, detached, no
    gradient, no stop) takes a lean path: one detach, one clone (none when zero-copy), one tuple,
    one append (the benchmark goal is <= 1.15x the cost of the same hand-written hook)."""

    __slots__ = (
        "clone",
        "counter",
        "entries",
        "finish",
        "last",
        "lean",
        "name",
        "rec",
        "scope_",
        "track",
    )

    def __init__(self, rec: _Recorder, scope: HookScope, name: str, finish: Any) -> None:
        # _Hook's other fields are set by HookScope when the hook is registered
        self.fn = None  # type: ignore[assignment]
        self.rec, self.scope_, self.name, self.finish = rec, scope, name, finish
        self.entries: list[Any] = rec.calls.setdefault(name, [])
        self.counter = itertools.count()
        self.last = rec.keep == "last"
        self.clone = rec.clone
        self.track = not rec.clone
        self.lean = rec.simple and finish is None
        rec.hooks.append(self)

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return None  # another thread's call (see acts_here)
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        if (
            graph_task_id() != -1
        ):  # activation checkpointing re-running forward (docs/pitfalls.md §27)
            if self.rec.recomputes.pending:  # reentrant: the gradient flows through the recompute
                call = self.rec.recomputes.claim(self.name, output)
                if call is not None:
                    call._grad, _ = self.rec.attach_grads(self.scope_, self.name, output, "")
            return None
        entry: Any
        if self.lean and output.__class__ is torch.Tensor:
            if self.clone:
                entry = (next(self.counter), output.detach().clone(), None)
            else:
                t = output.detach()
                try:
                    entry = (next(self.counter), t, t._version)
                except RuntimeError:  # inference tensors have no version counter
                    entry = (next(self.counter), t, None)
            entries = self.entries
            if self.last and entries:
                entries[0] = entry
            else:
                entries.append(entry)
            return None
        return self._record(output)

    def _record(self, output: Any) -> None:
        rec = self.rec
        index = next(self.counter)
        finish = self.finish
        # the call that completes stop=True ends the forward right after this hook: nothing can
        # change its output any more, so it is kept without a copy (and still version-checked)
        final = finish is not None and finish.final(self.name)
        if output.__class__ is torch.Tensor and rec.simple:
            t = output.detach()
            if self.clone and not final:
                entry = (index, t.clone(), None)
            else:
                try:
                    entry = (index, t, t._version)
                except RuntimeError:  # inference tensors have no version counter
                    entry = (index, t, None)
        else:
            entry = call = Call(self.name, index)
            versions: list[tuple[torch.Tensor, int]] | None = [] if self.track or final else None
            call._output = rec.store(output, versions, final)
            call._versions = versions
            if rec.want_grads:
                call._grad, _ = rec.attach_grads(
                    self.scope_, self.name, output, f"{self.name!r}", (self.name, call)
                )
        entries = self.entries
        if self.last and entries:
            entries[0] = entry
        else:
            entries.append(entry)
        if finish is not None:
            finish(self.name)
        return None


class _Finish:
    """Counts down the layers a ``stop=True`` scope waits for; raises the stop signal at zero."""

    __slots__ = ("pending", "signal")

    def __init__(self, names: Any, signal: Any) -> None:
        self.pending, self.signal = set(names), signal

    def final(self, name: str) -> bool:
        """Whether ``name`` finishing now ends the forward pass."""
        pending = self.pending
        return len(pending) == 1 and name in pending

    def __call__(self, name: str) -> None:
        pending = self.pending
        if pending and name in pending:
            pending.discard(name)
            if not pending:
                raise self.signal()


class Capture(Mapping[str, Any]):
    """Result of :func:`capture`: a read-only mapping ``{layer: output of its last call}``.

    Also a context manager (exiting removes the hooks; recorded values stay readable).

    Attributes:
        grads: mapping ``{layer: gradient w.r.t. the output of its last call}``.
        inputs: mapping ``{layer: Inputs(args, kwargs) of its last call}``.
        layers: the layers that were selected, in model order.
        stopped: ``True`` once a ``stop=True`` scope ended the forward pass early (the rest of
            the ``with`` block was skipped).
    """

    def __init__(
        self,
        model: nn.Module,
        named: dict[str, nn.Module],
        recorder: _Recorder,
        stop: bool,
        sequence: bool = False,
        track: bool = True,
    ) -> None:
        self._model_type = type(model).__name__
        self._rec = recorder
        self.layers: list[str] = list(named)
        self._scope = HookScope("capture")
        self._stop = stop
        self.stopped = False
        self.grads = _GradView(self)
        self.inputs = _InputView(self)
        self._tokens: TokenTracker | None = None
        try:
            self._register(named)
            if track:  # a module replaced while open: said when read
                self._scope.track(model, named)
            warn_tp_shards(self._scope, model, named)
            if sequence:
                self._tokens = TokenTracker(
                    {n: recorder.calls.setdefault(n, []).__len__ for n in named}
                )
                self._tokens.attach(self._scope, model)
        except BaseException:
            self._scope.remove()
            raise

    # -- hooks ----------------------------------------------------------------------------------
    def _register(self, named: dict[str, nn.Module]) -> None:
        rec, scope = self._rec, self._scope
        finish = _Finish(named, scope.stop_signal) if self._stop else None
        if rec.want_inputs:
            for name, module in named.items():
                self._register_with_inputs(name, module, finish)
        else:
            scope.add_forward_many(
                (module, _OutputHook(rec, scope, name, finish), name)
                for name, module in named.items()
            )

    def _register_with_inputs(self, name: str, module: nn.Module, finish: _Finish | None) -> None:
        rec, scope = self._rec, self._scope
        stack: list[Call] = []
        track_versions = not rec.clone
        in_key = name + "\0inputs"

        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if in_backward():  # a recompute: reentrant checkpointing's gradients flow through it
                claimed = rec.recomputes.claim(in_key, (args, kwargs)) if rec.want_grads else None
                if claimed is None:
                    return None
                replaced = identity_views(args, kwargs)
                claimed._in_grad, _ = rec.attach_grads(scope, name, replaced, "")
                return replaced
            call = rec.new_call(name)
            stack.append(call)
            replaced = None
            if (
                rec.want_grads
                and not torch.is_grad_enabled()
                and rec.recomputes.note(in_key, (args, kwargs), call)
            ):
                call._in_grad = _GradSlots(0, REENTRANT_HINT)
            if (
                rec.want_grads
                and torch.is_grad_enabled()
                and any(t.requires_grad for _, t in iter_tensors((args, kwargs)))
            ):
                # gradients through this layer only; identity checks keep their path (docs/pitfalls.md §4)
                views: list[tuple[torch.Tensor, int]] = []
                replaced = identity_views(args, kwargs, lambda v, _t: views.append((v, v._version)))
                call._in_grad, _ = rec.attach_grads(scope, name, replaced, f"inputs of {name!r}")
                call._in_views = views
            elif rec.want_grads and torch.is_grad_enabled() and call._in_grad is None:
                call._in_grad = _GradSlots(
                    0,
                    "none of its inputs requires grad (the model's input batch, or values made "
                    "under torch.no_grad()), so no gradient reaches them",
                )
            versions: list[tuple[torch.Tensor, int]] | None = [] if track_versions else None
            a, k = replaced if replaced is not None else (args, kwargs)
            # copied before forward runs: the layer itself may change its input (ReLU(inplace=True))
            call.inputs = Inputs(rec.store(tuple(a), versions), rec.store(dict(k), versions))
            call._in_versions = versions
            return replaced

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if in_backward():
                claimed = rec.recomputes.claim(name, output) if rec.want_grads else None
                if claimed is not None:
                    claimed._grad, _ = rec.attach_grads(scope, name, output, "")
                return
            if not stack:
                return
            call = stack.pop()
            views = call._in_views
            if views and any(v._version != n for v, n in views):
                # the layer changed its input in place: PyTorch drops the gradient hook of a view
                # changed in place, so the input gradient through this layer is not recorded
                call._in_grad = _GradSlots(
                    0,
                    f"{name!r} changed its input in place (e.g. nn.ReLU(inplace=True)); PyTorch "
                    "drops a gradient hook on a tensor view changed in place, so the gradient of "
                    "the input it was given is not recorded. Capture the layer before it (its "
                    "output's gradient), or use the module with inplace=False",
                )
            call._in_views = None
            final = finish is not None and finish.final(name)
            versions: list[tuple[torch.Tensor, int]] | None = (
                [] if track_versions or final else None
            )
            call._output = rec.store(output, versions, final)
            call._versions = versions
            if rec.want_grads:
                call._grad, _ = rec.attach_grads(scope, name, output, f"{name!r}", (name, call))
            if finish is not None:
                finish(name)

        scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
        scope.add_forward(module, post, layer=name, with_kwargs=True)

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        self._scope.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        suppressed = self._scope.__exit__(exc_type, exc, tb)
        self.stopped = self.stopped or bool(suppressed)
        if self._stop and exc is None:
            missing = self.missing
            for name in missing:  # (one whose hooks were replaced or removed: say so)
                self._check_hooked(name, "capture(stop=True): ")
            if missing:
                raise LayerNotRunError(
                    f"capture(stop=True): layer(s) {', '.join(map(repr, missing))} of {self._model_type} "
                    f"never ran, so the forward pass was not stopped early; "
                    f"{self._never_ran(missing)}"
                )
        return suppressed

    def remove(self) -> None:
        """Remove the hooks now (values recorded so far stay readable)."""
        self._scope.remove()

    @property
    def active(self) -> bool:
        """Whether the hooks are still attached (``False`` once closed, or once
        ``hs.remove_hooks`` took them all)."""
        return self._scope.active and self._scope.num_hooks > 0

    # -- reading --------------------------------------------------------------------------------
    @property
    def missing(self) -> list[str]:
        """Selected layers that have not run (yet)."""
        return [n for n in self.layers if not self._rec.calls.get(n)]

    def calls(self, layer: str) -> list[Call]:
        """Every recorded call of ``layer``, in order (a module used twice gives two)."""
        self._check(layer)
        self._check_hooked(layer)
        return list(self._rec.materialize(layer))

    def last(self, layer: str) -> Call:
        """The last recorded call of ``layer``."""
        self._check(layer)
        self._check_hooked(layer)
        calls = self._rec.materialize(layer)
        if not calls:
            raise LayerNotRunError(
                f"layer {layer!r} was selected but nothing was recorded: {self._never_ran([layer])}"
            )
        return calls[-1]

    def _check(self, layer: str) -> None:
        if layer not in self.layers:
            if len(self.layers) <= 8:
                listed = "the captured layers are " + ", ".join(repr(x) for x in self.layers)
            else:
                listed = "closest captured layers: " + ", ".join(
                    repr(x) for x in suggest(layer, self.layers)
                )
            raise LayerNotFoundError(f"{layer!r} is not a captured layer; {listed}")

    def _never_ran(self, layers: list[str]) -> str:
        """Why ``layers`` recorded nothing: a deep copy of the model ran them (its hooks are
        inert), or the usual causes."""
        copied = [n for n in layers if ran_in_copy(self._scope, n)]
        if not copied:
            return _NEVER_RAN_HINT
        return (
            f"a deep copy of the model (copy.deepcopy, made while the capture was open) called "
            f"{', '.join(map(repr, copied))}, and a copy's hooks are inert: capture the copy "
            "(hs.capture(the_copy, ...)), or call the model the capture was opened on"
        )

    def _lost(self, layer: str) -> str | None:
        """Why the hooks of ``layer`` stopped seeing its calls while the scope was open (the
        message's first part), if they did: the model holds another module at that name now, or
        ``hs.remove_hooks`` took them. ``None`` when they saw every call."""
        scope = self._scope
        recorded = bool(self._rec.calls.get(layer))
        if layer in scope.stripped:
            return (
                "the hooks of this capture were removed by hs.remove_hooks(...) while it was open, "
                f"so {layer!r} recorded nothing after that"
                + ("" if recorded else " (and nothing before)")
            )
        now = scope.replaced(layer)
        if now is None:
            return None
        where = attribute_path(layer)
        if now.endswith(_GONE):  # taken out of the model: nothing runs at that name
            return (
                f"layer {layer!r} was removed from the model while this capture was open "
                f"({now})"
                + (
                    ": what was recorded is of the module that was there"
                    if recorded
                    else ", and it never ran in the scope before that"
                )
                + f"; open the capture after removing {where}"
            )
        return (
            f"layer {layer!r} was replaced while this capture was open ({now}): the capture's "
            "hooks stay on the module it replaced, so calls of the new module are not recorded"
            + (
                " and what was recorded is the replaced module's"
                if recorded
                else " (and the replaced one never ran in the scope)"
            )
            + f"; open the capture after replacing {where}"
        )

    def _check_hooked(self, layer: str, prefix: str = "") -> None:
        """Refuse a read of ``layer`` whose hooks stopped seeing its calls while the scope was
        open (see :meth:`_lost`): a replaced module raises, as does a layer ``hs.remove_hooks``
        left with nothing recorded; calls recorded before ``hs.remove_hooks`` (its use: cleaning
        up a scope never closed) are read with a warning that later calls are missing."""
        lost = self._lost(layer)
        if lost is None:
            away = self._scope.elsewhere.get(layer)
            if away is None:
                return
            # calls a worker thread the forward started made: not recorded
            why = (
                f"layer {layer!r} ran in thread {away!r}, which the model's forward started and "
                "waited on, while the capture was open: a scope acts only on the calls of the "
                "thread that opened it (docs/guide/core.md, Threads), so those calls were not "
                "recorded"
            )
            fix = "; run the layer in the forward's own thread (or open the capture in the worker)"
            if not self._rec.calls.get(layer):
                raise LayerNotRunError(prefix + why + fix)
            key = "elsewhere\0" + layer
            if key not in self._rec.warned:
                self._rec.warned.add(key)
                warnings.warn(
                    f"{why}: the values read are its calls in this thread only{fix}",
                    HookscopeWarning,
                    stacklevel=4,
                )
            return
        if layer not in self._scope.stripped:
            raise LayerNotRunError(prefix + lost)
        if not self._rec.calls.get(layer):
            raise LayerNotRunError(
                f"{prefix}{lost}: keep hs.remove_hooks for scopes that were never closed, or "
                "open a new capture after it"
            )
        key = "stripped\0" + layer
        if key not in self._rec.warned:
            self._rec.warned.add(key)
            warnings.warn(
                f"{lost}: the values read are those recorded before it, and a call after it is "
                "not among them; close a capture you still read with `with` or .remove(), not "
                "hs.remove_hooks",
                HookscopeWarning,
                stacklevel=4,
            )

    def clear(self) -> None:
        """Drop every recorded call (keeps the hooks)."""
        self._rec.clear()
        if self._tokens is not None:
            self._tokens.clear()

    def sequence(self, layer: str) -> TokenSequence:
        """``layer``'s values over the whole token sequence, aligned by token position.

        Needs ``capture(..., sequence=True)``. Around ``model.generate()`` or any loop of
        KV-cached forward calls, the calls of ``layer`` (the prompt, then one token per call) are
        put together into ``values[batch, positions, ...]`` (the hidden-state tensor: the first
        tensor of a tuple output), where ``values[b, p]`` belongs to row ``b``'s ``p``-th real
        token: left padding is taken out, so rows of different prompt lengths line up, and
        ``mask[b, p]`` says which slots hold a real token (``False`` past a row's end, where
        ``values`` is zero). ``tokens`` gives the token ids in the same layout. Beam search's
        reorder of rows between calls is followed: row ``b`` is the history of row ``b`` of the
        last model call. The last token ``generate`` returns was never run through the model, so
        a row holds one position fewer than the returned sequence. See
        :mod:`hookscope.core._sequence` for how positions are read and the limits.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> net = nn.Sequential(nn.Embedding(10, 3), nn.Linear(3, 2))
            >>> with hs.capture(net, "0", sequence=True) as cap:
            ...     _ = net(torch.tensor([[4, 5, 6]]))
            >>> seq = cap.sequence("0")
            >>> seq.values.shape, seq.mask.tolist(), seq.tokens.tolist()
            (torch.Size([1, 3, 3]), [[True, True, True]], [[4, 5, 6]])
        """
        self._check(layer)
        self._check_hooked(layer)
        if self._tokens is None:
            raise SequenceError(
                f"sequence({layer!r}) needs the token positions of each model call: open the "
                "capture with hs.capture(model, layers, sequence=True)"
            )
        return assemble(self._tokens, layer, [c.output for c in self._rec.materialize(layer)])

    def __getitem__(self, layer: str) -> Any:
        return self.last(layer).output

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.layers if self._rec.calls.get(n))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        done = {n: len(self._rec.calls.get(n, ())) for n in self.layers}
        return f"<Capture {state} {done}>"


class _GradView(Mapping[str, Any]):
    def __init__(self, cap: Capture) -> None:
        self._cap = cap

    def __getitem__(self, layer: str) -> Any:
        return self._cap.last(layer).grad

    def __iter__(self) -> Iterator[str]:
        for n in self._cap:
            g = self._cap.last(n)._grad
            if g is not None and any(x is not None for x in g.grads):
                yield n

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _InputView(Mapping[str, Inputs]):
    def __init__(self, cap: Capture) -> None:
        self._cap = cap

    def __getitem__(self, layer: str) -> Inputs:
        call = self._cap.last(layer)
        if call._inputs is None:
            raise LayerNotRunError(
                f"inputs of {layer!r} were not captured; use capture(..., inputs=True)"
            )
        inputs = call.inputs
        assert inputs is not None
        return Inputs(tuple(map_tensors(ready, inputs.args)), map_tensors(ready, inputs.kwargs))

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._cap if self._cap.last(n)._inputs is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def capture(
    model: nn.Module,
    layers: Any,
    *,
    inputs: bool = False,
    grads: bool = False,
    detach: bool = True,
    clone: bool = True,
    to: str | torch.device | None = None,
    stop: bool = False,
    keep: Literal["all", "last"] = "all",
    sequence: bool = False,
) -> Capture:
    """Record the outputs (and optionally inputs and gradients) of layers, every call, in order.

    Hooks are attached when called and removed when the ``with`` block exits (or on
    :meth:`Capture.remove`); what was recorded stays readable afterwards.

    Args:
        model: any ``nn.Module``.
        layers: a selector or list of selectors (see :func:`find`), or a ``{name: module}`` dict.
        inputs: also record positional and keyword inputs (``cap.inputs[name]``).
        grads: also record gradients w.r.t. outputs (``cap.grads[name]``), and w.r.t. inputs when
            ``inputs=True`` (``cap.last(name).input_grad``). Uses tensor hooks, so in-place ops
            (``ReLU(inplace=True)``) are fine; never the legacy backward hook.
        detach: store detached tensors (the default; keeps no autograd graph alive).
        clone: store copies (the default), so what you read is what the layer returned or
            received even when the model changes that tensor in place later (``out += identity``
            in a residual block, ``ReLU(inplace=True)``). ``clone=False`` keeps the model's own
            tensors (zero-copy: no extra memory or copy time); reading one that the model changed
            in place since then gives the changed values and an :class:`InPlaceModifiedWarning`.
            No copy is made where none is needed: with ``to=`` another device (the transfer is
            the copy), and for the layer whose call ends a ``stop=True`` forward pass.
        to: move stored tensors to this device (asynchronous from CUDA to CPU).
        stop: end the forward pass as soon as every selected layer has run once. It ends by
            raising an exception inside the model, which the ``with`` block swallows at its end:
            **the rest of the block is skipped** (``out = model(x)`` is never assigned, code
            after it never runs). ``cap.stopped`` is ``True`` afterwards when that happened. For
            a call that returns normally, use :class:`FeatureExtractor` (``fx(x)`` returns
            ``{layer: output}`` and stops early too). A selected layer that never runs raises
            :class:`LayerNotRunError` at exit.
        keep: ``"all"`` keeps every call; ``"last"`` only the latest per layer (long loops).
        sequence: also read where each model call's tokens sit (a pre-hook on the root model),
            so that :meth:`Capture.sequence` can align the calls of ``model.generate()`` or of a
            KV-cached loop token by token.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> x = torch.randn(2, 3)
        >>> with hs.capture(net, ["0", "2"], grads=True) as cap:
        ...     net(x).sum().backward()
        >>> cap["0"].shape, cap.grads["2"].tolist()
        (torch.Size([2, 4]), [[1.0], [1.0]])
    """
    check_model(model)
    named = resolve(model, layers)
    for arg, v in (
        ("inputs", inputs),
        ("grads", grads),
        ("detach", detach),
        ("clone", clone),
        ("stop", stop),
        ("sequence", sequence),
    ):
        if not isinstance(v, bool):
            raise TypeError(f"capture: {arg} must be True or False; got {type(v).__name__}: {v!r}")
    if keep not in ("all", "last"):
        raise ValueError(f"keep must be 'all' or 'last', got {keep!r}")
    if sequence and (keep != "all" or stop):
        raise ValueError("capture(sequence=True) needs every call: use keep='all' and stop=False")
    device = device_arg(to, "capture: to") if to is not None else None
    recorder = _Recorder(
        inputs=inputs, grads=grads, detach=detach, clone=clone, to=device, keep=keep
    )
    return Capture(model, named, recorder, stop, sequence)
