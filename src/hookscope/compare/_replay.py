"""Replaying one module call of a live model on a recorded run's values, its children stubbed.

The replay of call ``c`` runs the target model's module on the recorded inputs of ``c``; each
module that ``c`` calls directly (its children in the call tree) does not run: it returns the
output the recorded run gave that child call (and, in backward, the recorded gradient of that
child call's inputs). So the replay measures what the module's **own** code adds (its glue
between children, or its whole computation for a leaf), and every module of the model is
replayed once: the replays together cost about one forward and backward of the model, whatever
its depth.

A child is stubbed by setting an instance attribute ``forward`` on it for the duration of the
replay (removed in a ``finally``); no hook is involved. A child call whose inputs do not have the
recorded structure runs for real (``Result.ran`` names it).

A child that works in place on what its caller handed it (``nn.ReLU(inplace=True)``) changed the
caller's tensor in the recorded run, and a caller may go on with that tensor rather than the
return value (``self.act(y); return self.out(y)``). So the stub does what the call did to its
caller: where the call changes an input in place and returns it, the recorded output is written
into the caller's tensor (and that tensor is the value returned, as in the run). Which calls do
this is seen by running them (:attr:`Replay.inplace`: a replay of the call, or the one pass);
a call that changes an input in place and returns another tensor leaves no record of the
input's value after it, so that child runs for real in its caller's replay
(``Result.ran_in_place`` names it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import named_modules, strip_compiled
from ..core._nested import continuous, iter_tensors, map_tensors, object_copier, tensors_of
from ._run import CallRec, RunRecord, restore_aliases
from ._store import ValueStore
from ._tolerance import Norms, narrowed, rel_pairs

__all__ = ["CopiesIn", "Replay", "Result"]


@dataclasses.dataclass
class Result:
    """What a replay gives: the output, the gradients w.r.t. the input leaves (aligned with the
    recorded ``in_grad``) and w.r.t. the module's parameters (local names), children that ran."""

    output: Any
    in_grads: list[torch.Tensor | None] | None = None
    param_grads: dict[str, torch.Tensor] | None = None
    ran: list[str] = dataclasses.field(default_factory=list)
    # what the module's own code handed to the calls it makes: their inputs (forward) and the
    # gradients of their outputs (backward), against the recorded run's
    # (lazy :class:`~._tolerance.Lazy` errors when the replay has ``norms``)
    child_errors: list[Any] = dataclasses.field(default_factory=list)
    child_grad_errors: list[Any] = dataclasses.field(default_factory=list)
    # the inputs the call changed in place: (input leaf, output leaf that is that input or None)
    in_place: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    # children that ran for real: they change an input in place and return another tensor
    ran_in_place: list[str] = dataclasses.field(default_factory=list)


def in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with its floating parameters and buffers cast to ``dtype``, in place; complex
    ones are kept (``Module.to(torch.bfloat16)`` casts a complex buffer to a real one, dropping
    its imaginary part: a reference made that way would be broken as such a B is)."""
    dtype_of = dtype
    return module._apply(lambda t: t.to(dtype_of) if t.is_floating_point() else t)


class CopiesIn(dict):  # type: ignore[type-arg]
    """A model's modules in another dtype, for replays: each module copied with its subtree (its
    own children, which a replay stubs) the first time a replay asks for it, not the whole model
    at once (the replays of a report's few flagged rows need a few small modules: a whole copy of
    a 4-block GPT-2 cost 5 ms of a 140 ms compare). A module inside a subtree already copied is
    that copy's own; a later copy of an ancestor replaces its descendants' standalone copies, so
    every module found here is its copied parent's child."""

    def __init__(self, source: dict[str, nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        self.source, self.dtype = source, dtype
        self.device = next((p.device for m in source.values() for p in m.parameters()), None)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        got = dict.get(self, name)
        if got is None and name in self.source:
            twin = in_dtype(copy.deepcopy(strip_compiled(self.source[name])), self.dtype)
            pre = f"{name}." if name else ""
            for sub, m in named_modules(twin):
                self[f"{pre}{sub}" if sub else name] = m
            got = twin
        return default if got is None else got


class _Stub(torch.autograd.Function):
    """Returns recorded outputs; in backward, the recorded gradients of the inputs. Where no
    gradient at all reaches its outputs (the caller overwrote the output in place: see
    :func:`write_back`), the caller's code does not reach the call: nothing is sent back (as
    the one pass's ``_Exit``)."""

    @staticmethod
    def forward(ctx: Any, payload: Any, *inputs: torch.Tensor) -> Any:
        outs, grads, ref_out_grads, sink, errors = payload
        ctx.grads, ctx.ref, ctx.sink, ctx.errors = grads, ref_out_grads, sink, errors
        ctx.set_materialize_grads(False)
        res = tuple(o.clone() for o in outs)
        ctx.like = [(o.shape, o.dtype, o.device) for o in res]
        nondiff = [o for o in res if not continuous(o)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return res

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if all(g is None for g in grads):
            return (None, *([None] * len(ctx.grads)))
        grads = tuple(
            torch.zeros(s, dtype=d, device=dev) if g is None else g
            for g, (s, d, dev) in zip(grads, ctx.like)
        )
        if ctx.ref is not None:
            ctx.sink.append(ctx.errors(list(zip(ctx.ref, grads))))
        return (None, *ctx.grads)


def _eager() -> Any:
    """Compiled code set aside (``torch.compiler.set_stance("force_eager")``, where torch has it)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _cast(
    value: Any,
    like: Any,
    dtype: torch.dtype,
    device: torch.device,
    round_to: torch.dtype | None = None,
    cache: dict[Any, Any] | None = None,
) -> Any:
    """``value``'s floating leaves cast to the dtypes of ``like``'s leaves (same structure, or a
    list of dtypes), else to ``dtype``; tensors met twice stay one tensor (identity checks such
    as ``q is k`` hold). ``cache``: casts kept across calls, by tensor and dtype (a record held in
    memory hands the next call the same object as the last output: it is cast once); whoever
    hands a cached cast to a module hands it a copy."""
    if value.__class__ is torch.Tensor:  # most outputs: one tensor (no walk)
        if like.__class__ is torch.Tensor:
            return _cast_leaf(value, like.dtype, dtype, device, round_to, cache)
        if like is None:
            return _cast_leaf(value, None, dtype, device, round_to, cache)
        if like.__class__ is list and len(like) == 1 and like[0].__class__ is torch.dtype:
            return _cast_leaf(value, like[0], dtype, device, round_to, cache)
    elif (
        value.__class__ is tuple
        and len(value) == 2
        and value[0].__class__ is tuple
        and len(value[0]) == 1
        and value[0][0].__class__ is torch.Tensor
        and value[1].__class__ is dict
        and not value[1]
        and like.__class__ is list
        and len(like) == 1
        and like[0].__class__ is torch.dtype
    ):  # most inputs: ((tensor,), {}) with its dtype kept
        return ((_cast_leaf(value[0][0], like[0], dtype, device, round_to, cache),), {})
    if isinstance(like, list) and all(isinstance(d, torch.dtype) for d in like):
        dts = like
    else:
        dts = [t.dtype for t in tensors_of(like)] if like is not None else []
    n = len(tensors_of(value))
    it = iter(dts if len(dts) == n else [None] * n)
    memo: dict[int, torch.Tensor] = {}

    def one(t: torch.Tensor) -> torch.Tensor:
        d = next(it)
        hit = memo.get(id(t))
        if hit is not None:
            return hit
        out = memo[id(t)] = _cast_leaf(t, d, dtype, device, round_to, cache)
        return out

    # an object among the values (a cache) is handed over as a copy, its tensors cast as the
    # others: a module growing it must not change the record
    return map_tensors(one, value, object_copier(lambda t: _cast_one(t, dtype, device, round_to)))


def _cast_leaf(
    t: torch.Tensor,
    d: torch.dtype | None,
    dtype: torch.dtype,
    device: torch.device,
    round_to: torch.dtype | None,
    cache: dict[Any, Any] | None,
) -> torch.Tensor:
    """One leaf of :func:`_cast`: in ``d`` (its dtype in the live run) where floating, else
    ``dtype``; through ``cache`` (by tensor and ``d``) where one is kept."""
    key = None
    if cache is not None:
        key = (id(t), d)
        got = cache.get(key)
        if got is not None and got[0] is t:
            return got[1]
    out = t.detach().to(device)
    if out.is_floating_point():
        out = narrowed(out, d if d is not None and d.is_floating_point else dtype)
        if round_to is not None:
            out = narrowed(out, round_to).to(out.dtype)
    if out.data_ptr() == t.data_ptr() and out.numel():
        out = out.clone()  # a module that works in place must not change the record
    if key is not None:
        cache[key] = (t, out)  # t is kept by the record: its id stays its own
    return out


def _cast_one(
    t: torch.Tensor, dtype: torch.dtype, device: torch.device, round_to: torch.dtype | None
) -> torch.Tensor:
    """A tensor inside an object (a cache) as :func:`_cast` casts a leaf without a known dtype:
    a copy on ``device``, floating ones in ``dtype``."""
    out = t.detach().to(device)
    if out.is_floating_point():
        out = narrowed(out, dtype)
        if round_to is not None:
            out = narrowed(out, round_to).to(out.dtype)
    return out.clone() if out.data_ptr() == t.data_ptr() and out.numel() else out


class _Overwrite(torch.autograd.Function):
    """``t.copy_(src)`` in place whose backward sends nothing to ``t``'s old value: the gradient
    that reaches a call's inputs is the one the call gives them (the stub's recorded one), not
    a zero from the overwrite (that would read as a gradient the caller sent back)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(t)
        ctx.dtype = src.dtype
        t.copy_(src)
        return t

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return None, None if grad is None else grad.to(ctx.dtype)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (``None`` for an inference tensor, which has none)."""
    return None if t.is_inference() else t._version


def _aliases(out: torch.Tensor, t: torch.Tensor) -> bool:
    """``out`` is ``t`` (the same tensor, or the same memory seen the same way)."""
    return out is t or (
        out.data_ptr() == t.data_ptr()
        and out.dtype == t.dtype
        and out.shape == t.shape
        and out.stride() == t.stride()
    )


def versions(handed: list[torch.Tensor]) -> list[int | None]:
    """The version counters of the tensors handed to a call, before it runs."""
    return [_version(t) for t in handed]


def changed_in_place(
    handed: list[torch.Tensor], before: list[int | None], output: Any
) -> list[tuple[int, int | None]]:
    """The tensors handed to a call (leaf ``k``, at version ``before[k]`` then) that it changed
    in place, each with the output leaf that is that tensor (``None``: it returned another).
    An inference tensor has no version: there, an output that is the tensor counts (writing
    the output back into the caller's tensor is then exact whether or not it changed)."""
    outs: list[torch.Tensor] | None = None
    found: list[tuple[int, int | None]] = []
    seen: set[int] = set()
    for k, (t, v) in enumerate(zip(handed, before)):
        if id(t) in seen or (v is not None and t._version == v):
            continue
        seen.add(id(t))
        if outs is None:
            outs = [o for _, o in iter_tensors(output)]
        j = next((j for j, o in enumerate(outs) if _aliases(o, t)), None)
        if j is not None or v is not None:
            found.append((k, j))
    return found


def write_back(given: list[torch.Tensor], outs: list[Any], in_place: Any) -> list[Any]:
    """``outs`` (what stands for a call's output) with each output leaf that is an input the call
    changed in place replaced by the caller's tensor, into which its value is written: what the
    call did to its caller in the recorded run. ``in_place``: aliased pairs only."""
    outs = list(outs)
    for k, j in in_place:
        outs[j] = _Overwrite.apply(given[k], outs[j])
    return outs


@dataclasses.dataclass
class Replay:
    """Replays calls of ``ref`` (a recorded run) on ``modules`` (a live model's eager modules).

    ``own``: the live model's own recorded run, whose values give the dtype each replayed value
    takes; ``name_map`` maps ``ref``'s names to the live model's (``None``: no counterpart).
    """

    modules: dict[str, nn.Module]
    ref: RunRecord
    own: RunRecord | None
    name_map: Callable[[str], str | None]
    dtype: torch.dtype
    autocast: torch.dtype | None = None
    round_to: torch.dtype | None = None  # round replayed values through this dtype
    norms: Norms | None = None  # the errors of the children's values: lazily, with others
    # position in ``ref`` -> the inputs that call changes in place (:func:`changed_in_place`),
    # as seen when it ran on the recorded inputs (a replay of it, or the one pass)
    inplace: dict[int, list[tuple[int, int | None]]] = dataclasses.field(default_factory=dict)

    def _errors(self, pairs: list[Any]) -> Any:
        return self.norms.rel_pairs(pairs) if self.norms is not None else rel_pairs(pairs)

    def _own_call(self, c: CallRec) -> CallRec | None:
        name = self.name_map(c.name)
        if self.own is None or name is None:
            return None
        pos = self.own.by_key.get((name, c.index))
        return None if pos is None else self.own.calls[pos]

    def ref_in_memory(self) -> bool:
        """Whether every value of ``ref`` is held in memory (one object per value, read back as
        that object): a store never spilled to disk."""
        calls = self.ref.calls
        if not calls:
            return False
        store = calls[0].store
        store = getattr(store, "store", store)
        return isinstance(store, ValueStore) and store.in_memory

    def _device(self) -> torch.device:
        if isinstance(self.modules, CopiesIn) and self.modules.device is not None:
            return self.modules.device
        for m in self.modules.values():
            for p in m.parameters():
                return p.device
        return torch.device("cpu")

    def run(self, pos: int, grads: bool) -> Result | None:
        """Replay ``ref.calls[pos]``; ``None`` when the live model has no such module or the call
        was not recorded with its inputs."""
        c = self.ref.calls[pos]
        name = self.name_map(c.name)
        module = self.modules.get(name) if name is not None else None
        if module is None or c.inputs is None:
            return None
        own = self._own_call(c)
        device = self._device()
        args, kwargs = _cast(
            restore_aliases(c.inputs, c.alias),
            own.input_dtypes if own else None,
            self.dtype,
            device,
            self.round_to,
        )
        leaves: list[torch.Tensor | None] = []
        want = c.in_grad if grads and c.in_grad is not None else None
        if want is not None:
            args, kwargs, leaves = _requiring(args, kwargs, want)
        res = Result(None)
        ctx = (
            torch.autocast(device_type=device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        handed = [t for _, t in iter_tensors((args, kwargs))]
        before = versions(handed)
        # eagerly: a module compiled in place (module.compile()) would run its compiled code,
        # and Dynamo would trace the replay's stubs (what compilation adds is compile_error's)
        with torch.set_grad_enabled(grads), self._stubs(c, device, res), ctx, _eager():
            out = module(*args, **kwargs)  # with the module's own hooks, as in its run
        res.in_place = self.inplace[pos] = changed_in_place(handed, before, out)
        res.output = map_tensors(lambda t: t.detach(), out)
        if grads and c.grad is not None:
            self._backward(module, out, c, leaves, res)
        return res

    def _backward(
        self, module: nn.Module, out: Any, c: CallRec, leaves: list[Any], res: Result
    ) -> None:
        outs, gouts = [], []
        assert c.grad is not None
        for (_, o), g in zip(iter_tensors(out), c.grad):
            if g is not None and o.requires_grad:
                outs.append(o)
                g = g.to(device=o.device, dtype=o.dtype)
                if self.round_to is not None:
                    g = g.to(self.round_to).to(o.dtype)
                gouts.append(g)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        targets = [t for t in leaves if t is not None] + [p for _, p in params]
        if not outs or not targets:
            res.in_grads = [None] * len(leaves)
            res.param_grads = {}
            return
        got = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
        it = iter(got)
        res.in_grads = [None if t is None else next(it) for t in leaves]
        res.param_grads = {n: g for (n, _), g in zip(params, it) if g is not None}

    def _in_place(self, pos: int) -> list[tuple[int, int | None]]:
        """What call ``pos`` changes in place (:attr:`inplace`), seen once by replaying it
        (forward only) where neither a replay of it nor the one pass has yet. A call that cannot
        be replayed counts as changing nothing: its own row says it could not be replayed."""
        got = self.inplace.get(pos)
        if got is None:
            try:
                self.run(pos, False)
            except Exception:  # its own row replays it again and says why it fails
                pass
            got = self.inplace.setdefault(pos, [])
        return got

    @contextlib.contextmanager
    def _stubs(self, c: CallRec, device: torch.device, res: Result) -> Iterator[None]:
        for k in c.children:  # before any stub is set: these replays run the children
            self._in_place(k)
        queues: dict[int, tuple[nn.Module, list[tuple[int, CallRec]]]] = {}
        for k in c.children:
            child = self.ref.calls[k]
            name = self.name_map(child.name)
            m = self.modules.get(name) if name is not None else None
            if m is None:
                continue
            queues.setdefault(id(m), (m, []))[1].append((k, child))
        saved: list[tuple[nn.Module, Any, dict[str, Any]]] = []
        try:
            for m, queue in queues.values():
                # the stub stands for the child's whole call: its own hooks (a forward hook that
                # changes its output is the child's) do not run on A's recorded values
                hooks = {a: m.__dict__[a] for a in _HOOK_DICTS if a in m.__dict__}
                saved.append((m, m.__dict__.get("forward", _ABSENT), hooks))
                for a in hooks:
                    m.__dict__[a] = type(hooks[a])()
                m.forward = self._stub(m, queue, device, res)
            yield
        finally:
            for m, prev, hooks in saved:
                if prev is _ABSENT:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = prev
                m.__dict__.update(hooks)

    def _stub(
        self, m: nn.Module, queue: list[tuple[int, CallRec]], device: torch.device, res: Result
    ) -> Callable[..., Any]:
        prev = m.__dict__.get("forward")
        real = prev if prev is not None else type(m).forward.__get__(m)
        pending = list(queue)

        def forward(*args: Any, **kwargs: Any) -> Any:
            given = [t for _, t in iter_tensors((args, kwargs))]
            pos, child = pending.pop(0) if pending else (-1, None)
            if (
                child is None
                or child.inputs is None
                or len(given) != sum(1 for _ in iter_tensors(child.inputs))
            ):
                res.ran.append(child.name if child is not None else type(m).__name__)
                return real(*args, **kwargs)
            in_place = self.inplace.get(pos, [])
            if any(j is None for _, j in in_place):
                # it changes what it was handed and returns another tensor: the value its caller
                # keeps is not recorded, so it runs for real (on the caller's values)
                res.ran_in_place.append(child.name)
                return real(*args, **kwargs)
            # a copy of what was handed: the norms come later, and the caller may change its
            # tensor in place after the call (h += f(ln(h)))
            handed = [t.detach().clone() if continuous(t) else t for t in given]
            res.child_errors.append(
                self._errors(list(zip([t for _, t in iter_tensors(child.inputs)], handed)))
            )
            own = self._own_call(child)
            value = _cast(
                child.output, own.output if own else None, self.dtype, device, self.round_to
            )
            outs = [t for _, t in iter_tensors(value)]
            if not outs:
                return value
            grads: list[Any] = [None] * len(given)
            if child.in_grad is not None and torch.is_grad_enabled():
                seen: set[int] = set()  # a tensor passed twice (q is k) gets its gradient once
                for i, (t, g) in enumerate(zip(given, child.in_grad)):
                    if g is not None and t.requires_grad and id(t) not in seen:
                        grads[i] = g.to(device=t.device, dtype=t.dtype)
                    seen.add(id(t))
            if any(g is not None for g in grads):
                payload = (outs, grads, child.grad, res.child_grad_errors, self._errors)
                made = list(_Stub.apply(payload, *given))
            else:
                made = [o.clone() for o in outs]
            if in_place:
                made = write_back(given, made, in_place)
            it = iter(made)
            return map_tensors(lambda _t: next(it), value)

        return forward


def _requiring(
    args: Any, kwargs: Any, want: list[torch.Tensor | None]
) -> tuple[Any, Any, list[torch.Tensor | None]]:
    """The inputs with a fresh leaf (requiring grad) for every floating input that has a recorded
    gradient; the model sees a copy of each leaf, so in-place layers work. Returns the leaves,
    aligned with ``want`` (``None`` elsewhere)."""
    leaves: list[torch.Tensor | None] = []
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    it = iter(want)

    def one(t: torch.Tensor) -> torch.Tensor:
        g = next(it, None)
        hit = memo.get(id(t))
        if hit is not None:
            leaves.append(None)  # the same tensor twice: its gradient is counted on the first
            return hit[1]
        if g is None or not continuous(t):
            leaves.append(None)
            return t
        leaf = t.detach().requires_grad_(True)
        used = leaf.clone()
        memo[id(t)] = (leaf, used)
        leaves.append(leaf)
        return used

    a = map_tensors(one, args)
    k = map_tensors(one, kwargs)
    return a, k, leaves


class _Absent:
    pass


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


_ABSENT: Any = _Absent()
