"""Every module call of a live model replayed on a recorded run's values in **one** forward and
one backward: the per-call replay of :mod:`._replay`, done for all calls together.

A forward pre-hook on each module replaces the inputs its caller computed by the recorded run's
inputs to that call (cast like :class:`~._replay.Replay` casts them); a forward hook keeps the
module's own output and hands the caller the recorded output instead. So each module runs once,
on the recorded inputs, and each caller's code runs on the recorded outputs of the calls it makes:
per call, exactly what :meth:`Replay.run <._replay.Replay.run>` computes with the children
stubbed, and what the caller handed to each call (its inputs, and in backward the gradient of its
output) is compared with the recorded run's, as the stubs do. In backward the same boundaries
hold (two autograd functions): a call's output gets the recorded gradient of that output, the
caller gets the recorded gradient of the call's inputs, and the gradient that reaches a call's
replaced inputs is that call's local input gradient. One ``autograd.grad`` gives them all, with
the parameter gradients summed over the calls of each module. Its roots are a handle (a zero
scalar output) of each of those functions, not the model's output: every call's own output is
seeded even where its caller's code sends no gradient back to it (an output dropped, detached, or
a gradient the record lacks), and the caller gets the recorded input gradients of a call only
where its code does send one back (as the per-call replay's stubs).

Each module's own parameters are, for the duration of each of its calls, leaves of the pass (the
module's ``_parameters`` entries swapped, put back when the call returns; one leaf per module
and parameter, so the gradients of its calls add up there as on the parameter): their gradients
are the module's own calls', ``param_grads``. A gradient that reaches a
parameter itself comes from a use outside its owners' calls (a caller's ``h @ lin.weight``, a
tied embedding used as ``h @ embed.weight.T``, ``nn.MultiheadAttention`` passing
``out_proj.weight`` to a function): ``used_outside`` names those parameters, and their owners and
the modules above them replay by themselves (``unforced``), where the per-call replay gives the
use to the caller's row (its gradient through the caller's own code) and the owner's per-call
gradients are compared with A's own replay, not A's whole ``.grad``.

A call that works in place on what its caller handed it (its handed inputs' versions moved)
changed the caller's tensor in the recorded run: where it returns that input, the recorded output
is written into the caller's tensor (as :func:`~._replay.write_back` does in the per-call
replay); where it returns another tensor, its caller is ``dirty`` (its replay runs the call for
real, and says so).

It is a fast path, taken only where it is exactly the per-call replay: a call whose caller runs
it in another way than the recorded run (not recorded there, another parent, another number of
tensors, no recorded inputs or output) is left to run as it is, and it and its caller are
``dirty`` (replayed one by one instead); a module that runs during backward (activation
checkpointing recomputes it, without these hooks) or an error voids the whole pass.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from ..core._nested import continuous, map_tensors, tensors_of
from ..core._scope import HookScope, _Hook, graph_task_id
from ._replay import Replay, Result, _cast, changed_in_place, versions, write_back
from ._run import CallRec, restore_aliases

__all__ = ["Forced", "forced_pass"]


class _Enter(torch.autograd.Function):
    """The replaced inputs of a call: forward gives the recorded inputs (copies), backward keeps
    what reached them. Its last output is a handle (a zero scalar), a root of the backward: the
    node runs even where nothing reaches the replaced inputs."""

    @staticmethod
    def forward(ctx: Any, box: Any, anchor: torch.Tensor) -> Any:
        forced, wanted, keep, owned = box
        ctx.keep = keep
        ctx.set_materialize_grads(False)
        outs = tuple(t if own else t.clone() for t, own in zip(forced, owned))
        nondiff = [o for o, w in zip(outs, wanted) if not w]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return (*outs, anchor.new_zeros(()))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.keep(grads[:-1])
        return None, None


class _Exit(torch.autograd.Function):
    """The output handed to the caller: forward gives the recorded output (copies), backward
    seeds the module's own output (``real``) with the recorded output gradient, compares what
    the caller sent back with the recorded one and, where the caller sent any, hands the
    tensors it passed to the call (``given``) the recorded input gradients (as the per-call
    replay's stub, whose backward runs only where the caller's code reaches it). Its last output
    is a handle (a zero scalar), a root of the backward: the module's output is seeded even
    where the caller drops or detaches it."""

    @staticmethod
    def forward(ctx: Any, box: Any, *tensors: torch.Tensor) -> Any:
        values, seeds, to_caller, on_grads, owned = box
        ctx.seeds, ctx.to_caller, ctx.on_grads = seeds, to_caller, on_grads
        ctx.set_materialize_grads(False)
        outs = tuple(v if own else v.clone() for v, own in zip(values, owned))
        nondiff = [o for o in outs if not continuous(o)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return (*outs, tensors[0].new_zeros((), dtype=torch.float32))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        sent = grads[:-1]
        if not any(g is not None for g in sent):  # the caller's code does not reach the call
            return (None, *ctx.seeds, *([None] * len(ctx.to_caller)))
        ctx.on_grads(sent)
        return (None, *ctx.seeds, *ctx.to_caller)


class Forced:
    """The results of a forced pass: ``results[pos]`` for each recorded call replayed exactly
    (its position in the recorded run), ``param_grads`` the live model's parameter gradients
    (full names) summed over the pass; ``dirty``: calls to replay one by one."""

    def __init__(self) -> None:
        self.results: dict[int, Result] = {}
        self.param_grads: dict[str, torch.Tensor] = {}
        self.dirty: set[int] = set()
        # live modules with a call left to run as it is: their parameter gradients in the pass
        # mix it in, so their rows replay by themselves
        self.unforced: set[str] = set()
        # parameters (the live model's full names) whose gradient in the pass comes partly from
        # uses outside their owners' calls
        self.used_outside: set[str] = set()
        # live module -> parameters of its children that never run as modules (names relative
        # to it: "out_proj.weight"), whose gradients are its calls' (see _Pass._swap)
        self.adopted: dict[str, list[str]] = {}
        self.void = ""  # why the whole pass is void ("" when it is not)


class _Frame:
    __slots__ = ("given", "handed", "output", "pos", "res", "to_caller", "versions")

    def __init__(self, pos: int, res: Result, output: Any) -> None:
        self.pos, self.res = pos, res
        # the recorded output, read when the call starts where the record is held in memory
        # (the same object a second read gives); None: read when it ends (a record on disk
        # gives a fresh copy per read, not held while the call runs)
        self.output = output
        # the tensors the caller handed to the call, and their recorded gradients (or None)
        self.given: list[torch.Tensor] = []
        self.to_caller: list[torch.Tensor | None] = []
        # what the module got instead (the recorded inputs) and their versions then
        self.handed: list[torch.Tensor] = []
        self.versions: list[int | None] = []


class _Casts(dict):  # type: ignore[type-arg]
    """The pass's cache of casts (:func:`~._replay._cast`'s ``cache``: ``(id(tensor), dtype) ->
    (tensor, cast)``), counting the reads left of each recorded tensor (one per call whose inputs
    hold it, one per call whose output does). A cast is a fresh tensor: at its tensor's last
    read it leaves the cache and goes to ``last`` (held there, so that no other tensor takes its
    id, until the next :meth:`_Pass._owned`), so that the call it is handed to takes it without
    a copy; a read the count did not foresee finds no entry and casts afresh (a copy more,
    never one shared)."""

    def __init__(self, calls: list[CallRec]) -> None:
        super().__init__()
        self.left: dict[int, int] = {}
        for c in calls:
            for value in (c.inputs, c.output):
                if value is not None:
                    for i in {id(t) for t in tensors_of(value)}:
                        self.left[i] = self.left.get(i, 0) + 1
        self.last: dict[int, torch.Tensor] = {}

    def _read(self, key: Any) -> bool:
        """One read of ``key``'s tensor: whether it was the last."""
        n = self.left.get(key[0], 0) - 1
        self.left[key[0]] = n
        return n <= 0

    def get(self, key: Any, default: Any = None) -> Any:  # type: ignore[override]
        got = dict.get(self, key)
        if got is not None and self._read(key):
            del self[key]
            self.last[id(got[1])] = got[1]
        return default if got is None else got

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._read(key):
            self.last[id(value[1])] = value[1]
        else:
            dict.__setitem__(self, key, value)


class _Swap:
    """One call's module with its own parameters (and those of its children that never run as
    modules) swapped for the pass's leaves while it runs."""

    __slots__ = ("module", "params")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # (the module holding it, local name, the parameter)
        self.params: list[tuple[nn.Module, str, torch.Tensor]] = []

    def restore(self) -> None:
        for m, n, p in self.params:
            m._parameters[n] = p  # type: ignore[assignment]


def forced_pass(rep: Replay, names: dict[int, str], grads: bool) -> Forced:
    """Replay every call of ``rep.ref`` on ``rep.modules`` in one forward (and, with ``grads``,
    one backward). ``names``: ``id(module) -> name`` of the live modules."""
    out = Forced()
    ref = rep.ref
    root = ref.by_key.get(("", 0))
    if root is None:
        out.void = "the record holds no call of the model"
        return out
    model = rep.modules.get(rep.name_map("") or "")
    if model is None:
        out.void = "no live model"
        return out
    pass_ = _Pass(rep, ref, names, grads, out)
    try:
        pass_.run(model, ref.calls[root])
    except Exception as exc:  # a module that cannot run this way: one by one instead
        out.results.clear()
        out.void = f"{type(exc).__name__}: {exc}"
    return out


class _Pass:
    def __init__(
        self, rep: Replay, ref: Any, names: dict[int, str], grads: bool, out: Forced
    ) -> None:
        self.rep, self.ref, self.names, self.grads, self.out = rep, ref, names, grads, out
        # the recorded call each live call stands for: (live name, occurrence) -> position
        self.by_live: dict[tuple[str, int], int] = {}
        for pos, c in enumerate(ref.calls):
            live = rep.name_map(c.name)
            if live is not None:
                self.by_live[(live, c.index)] = pos
        self.counts: dict[str, int] = {}
        self.stack: list[_Frame | None] = []  # None: a call left to run as it is
        self.device = rep._device()
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)
        # the roots of the backward: every _Enter's and _Exit's handle (each call's own output is
        # seeded, as in the per-call replay, whether or not the caller's code uses it)
        self.handles: list[torch.Tensor] = []
        self.swaps: list[_Swap] = []  # the calls running, with their parameters swapped
        # per live module: its children with parameters that never run as modules in the
        # recorded run, and their names (their parameters are the module's own code's to use)
        self.uncalled: dict[int, list[tuple[nn.Module, str]]] = {}
        called = {live for live, _ in self.by_live}
        for mname, m in rep.modules.items():
            for cn, child in m.named_children():
                full = f"{mname}.{cn}" if mname else cn
                if full in called or not any(
                    p is not None and p.requires_grad for p in child._parameters.values()
                ):
                    continue
                self.uncalled.setdefault(id(m), []).append((child, full))
                out.adopted.setdefault(mname, []).extend(
                    f"{cn}.{n}" for n, p in child.named_parameters(recurse=False) if p.requires_grad
                )
        # each recorded value cast once (an output handed to the next call is one object in a
        # record kept in memory): see _cast and _Casts
        self.casts: _Casts | None = _Casts(ref.calls) if rep.ref_in_memory() else None
        # (module, local name) -> (module's name, the leaf standing for that parameter)
        self.leaves: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}

    # -- the pass --------------------------------------------------------------------------------
    def run(self, model: nn.Module, call: CallRec) -> None:
        rep = self.rep
        scope = HookScope("compare")
        named = [
            (m, name) for m in rep.modules.values() if (name := self.names.get(id(m))) is not None
        ]
        scope.add_forward_many(
            [(m, _Hook(self._pre(name), "compare", "forward_pre", name, scope.id), name)
             for m, name in named],
            pre=True,
            with_kwargs=True,
            prepend=True,  # before the module's own pre-hooks, as the record's (see CallHooks)
        )  # fmt: skip
        scope.add_forward_many(
            [(m, _Hook(self._post(name), "compare", "forward", name, scope.id), name)
             for m, name in named],
            always_call=True,
        )  # fmt: skip
        args, kwargs = call.inputs
        ctx = (
            torch.autocast(device_type=self.device.type, dtype=rep.autocast)
            if rep.autocast is not None
            else contextlib.nullcontext()
        )
        with scope:  # still on in backward: a module recomputed there voids the pass
            try:
                with torch.set_grad_enabled(self.grads), ctx:
                    model(*args, **kwargs)
            finally:
                while self.swaps:  # an error midway: the model gets its parameters back
                    self.swaps.pop().restore()
            if self.grads and not self.out.void:
                self._backward()

    def _backward(self) -> None:
        outs = self.handles
        model = self.rep.modules[""]
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not outs:
            return
        leaves = [(f"{m}.{n}" if m else n, leaf) for (_, n), (m, leaf) in self.leaves.items()]
        with torch.enable_grad():
            # one root over every handle (zero scalars), seeded with zero: autograd checks and
            # seeds one output, not one per handle (their gradient is ignored by _Enter and
            # _Exit, whatever its value); handles on several devices or of several dtypes (a
            # default dtype other than float32 for the anchor's) stay roots of their own
            first = outs[0]
            one = all(t.device == first.device and t.dtype == first.dtype for t in outs)
            roots = [torch.stack(outs).sum()] if one and len(outs) > 1 else outs
            got = torch.autograd.grad(
                roots,
                [self.anchor, *(p for _, p in params), *(leaf for _, leaf in leaves)],
                [torch.zeros_like(t) for t in roots],
                allow_unused=True,
            )
        if self.out.void:
            return
        self.out.param_grads = {
            n: g for (n, _), g in zip(leaves, got[1 + len(params) :]) if g is not None
        }
        # a gradient on the parameter itself: a use outside its owners' calls
        outside = {id(p) for (_, p), g in zip(params, got[1:]) if g is not None}
        if outside:
            self._outside(outside)

    def _outside(self, params: set[int]) -> None:
        """Parameters used outside their owners' calls: their owners and every module above
        them replay by themselves (the per-call replay gives such a use to the caller's row)."""
        for name, m in self.rep.modules.items():
            hit = [n for n, p in m._parameters.items() if p is not None and id(p) in params]
            if not hit:
                continue
            self.out.used_outside.update(f"{name}.{n}" if name else n for n in hit)
            parts = name.split(".") if name else []
            for k in range(len(parts) + 1):
                self.out.unforced.add(".".join(parts[:k]))

    # -- hooks -----------------------------------------------------------------------------------
    def _pre(self, name: str) -> Any:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if graph_task_id() != -1:  # recomputed in backward (checkpointing): not forced
                self.out.void = f"{name or '<root>'} runs again in backward (checkpointing)"
                return None
            i = self.counts.get(name, 0)
            self.counts[name] = i + 1
            new = self._enter(name, i, args, kwargs)
            if self.grads:
                self._swap(module, name)
            return new

        return pre

    def _post(self, name: str) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> Any:
            if graph_task_id() != -1:
                return None
            if self.swaps and self.swaps[-1].module is module:
                self.swaps.pop().restore()
            if not self.stack:
                return None
            frame = self.stack.pop()
            if frame is None:
                return None
            return self._exit(frame, output)

        return post

    def _swap(self, module: nn.Module, name: str) -> None:
        """The module's own parameters as the pass's leaves while this call runs: the gradient
        each leaf gets is the module's calls', and a use of the parameter outside its owners'
        calls still reaches the parameter itself."""
        sw = _Swap(module)
        self._swap_own(sw, module, name)
        for child, cname in self.uncalled.get(id(module), ()):
            # a child that never runs as a module (nn.MultiheadAttention's out_proj): its
            # parameters are used by this module's own code, and their gradient is its calls'
            self._swap_own(sw, child, cname)
        self.swaps.append(sw)

    def _swap_own(self, sw: _Swap, module: nn.Module, name: str) -> None:
        own = module._parameters
        first: dict[int, str] = {}
        for n, p in list(own.items()):
            if p is not None and p.requires_grad:
                # one leaf per parameter, under its first name: a parameter the module holds
                # under two names (``self.w2 = self.w1``) is one parameter, whose gradient is
                # both names' uses (as ``named_parameters`` and A's ``.grad`` count it)
                key = (id(module), first.setdefault(id(p), n))
                hit = self.leaves.get(key)
                if hit is None:
                    hit = self.leaves[key] = (name, p.detach().requires_grad_(True))
                sw.params.append((module, n, p))
                own[n] = hit[1]  # type: ignore[assignment]

    def _enter(self, name: str, i: int, args: Any, kwargs: Any) -> Any:
        ref, rep = self.ref, self.rep
        pos = self.by_live.get((name, i))
        parent = next((f for f in reversed(self.stack) if f is not None), None)
        if not kwargs and args.__class__ is tuple and len(args) == 1:
            given = [args[0]] if args[0].__class__ is torch.Tensor else tensors_of(args)
        else:
            given = tensors_of((args, kwargs))
        c = ref.calls[pos] if pos is not None else None
        inputs = c.inputs if c is not None else None
        recorded = tensors_of(inputs) if inputs is not None else []
        output = c.output if c is not None else None
        if (
            c is None
            or inputs is None
            or output is None
            or c.parent != (parent.pos if parent is not None else None)
            or (parent is None and self.stack)
            or len(given) != len(recorded)
        ):
            # run as it is: not the per-call replay of this call, nor of the calls enclosing it
            for f in self.stack:
                if f is not None:
                    self.out.dirty.add(f.pos)
            if pos is not None:
                self.out.dirty.add(pos)
            self.out.unforced.add(name)
            self.stack.append(None)
            return None
        res = Result(None)
        frame = _Frame(pos, res, output if self.casts is not None else None)
        if parent is not None:
            # the errors are computed later (lazily, with the others): a copy of what the caller
            # handed, which its code may change in place after the call (``h += f(ln(h))``)
            handed = [t.detach().clone() if continuous(t) else t for t in given]
            parent.res.child_errors.append(rep._errors(list(zip(recorded, handed))))
        own = rep._own_call(c)
        value = _cast(
            restore_aliases(inputs, c.alias),
            own.input_dtypes if own else None,
            rep.dtype,
            self.device,
            rep.round_to,
            self.casts,
        )
        self.stack.append(frame)
        frame.given = given
        if not self.grads and self.casts is not None:
            # the module gets the cast values themselves: copies where the cast is still in the
            # cache (shared with other calls), so that one working in place leaves it as it was
            copies: dict[int, torch.Tensor] = {}
            owned = self._owned(tensors_of(value))
            mine = {id(t) for t, own in zip(tensors_of(value), owned) if own}

            def copy(t: torch.Tensor) -> torch.Tensor:
                c = copies.get(id(t))
                if c is None:
                    c = copies[id(t)] = t if id(t) in mine else t.clone()
                return c

            value = map_tensors(copy, value)
        leaves = tensors_of(value)
        if not self.grads:
            self.out.results[pos] = res
            frame.handed = leaves
            frame.versions = versions(leaves)
            return tuple(value[0]), dict(value[1])
        # which leaves get a gradient: floating, first occurrence, recorded gradient (as
        # _requiring); the caller gets the recorded gradient of what it passed (as the stubs)
        want = c.in_grad or []
        distinct: dict[int, int] = {}
        forced: list[torch.Tensor] = []
        wanted: list[bool] = []
        slots: list[int] = []
        kept: list[int] = []  # the leaves whose gradient is kept: floating, wanted, first
        for k, t in enumerate(leaves):
            j = distinct.get(id(t))
            if j is not None:
                slots.append(j)
                continue
            j = distinct[id(t)] = len(forced)
            slots.append(j)
            w = k < len(want) and want[k] is not None and continuous(t)
            forced.append(t)
            wanted.append(w)
            if w:
                kept.append(k)
        to_caller: list[torch.Tensor | None] = [None] * len(given)
        seen: set[int] = set()
        for k, (t, g) in enumerate(zip(given, want)):
            if g is not None and t.requires_grad and id(t) not in seen:
                to_caller[k] = g.to(device=t.device, dtype=t.dtype)
            seen.add(id(t))
        n = len(leaves)

        def keep(grads: tuple[Any, ...]) -> None:
            got: list[Any] = [None] * n
            for k in kept:
                got[k] = grads[slots[k]]
            res.in_grads = got

        res.in_grads = [None] * n
        frame.to_caller = to_caller
        *made, handle = _Enter.apply((forced, wanted, keep, self._owned(forced)), self.anchor)
        self.handles.append(handle)
        frame.handed = [made[j] for j in slots]
        frame.versions = versions(frame.handed)
        self.out.results[pos] = res
        args, kw = value
        if n == 1 and not kw and len(args) == 1 and args[0].__class__ is torch.Tensor:
            return (frame.handed[0],), {}  # most calls: one tensor in (no walk)
        it = iter(frame.handed)
        new = map_tensors(lambda _t: next(it), value)
        return tuple(new[0]), dict(new[1])

    def _exit(self, frame: _Frame, output: Any) -> Any:
        ref, rep = self.ref, self.rep
        c = ref.calls[frame.pos]
        res = frame.res
        if output.__class__ is torch.Tensor:
            res.output, real = output.detach(), [output]
        else:
            res.output = map_tensors(lambda t: t.detach(), output)
            real = tensors_of(output)
        parent = next((f for f in reversed(self.stack) if f is not None), None)
        in_place = res.in_place = rep.inplace[frame.pos] = changed_in_place(
            frame.handed, frame.versions, output
        )
        if parent is None:
            in_place = []  # the model itself: no caller's tensor to change
        elif any(j is None for _, j in in_place):
            # what the caller keeps after the call is not recorded: it replays by itself, the
            # call running for real there
            in_place = []
            self.out.dirty.add(parent.pos)
            live = rep.name_map(ref.calls[parent.pos].name)
            if live is not None:
                self.out.unforced.add(live)
        own = rep._own_call(c)
        recorded = frame.output if frame.output is not None else c.output
        value = _cast(
            recorded, own.output if own else None, rep.dtype, self.device, rep.round_to, self.casts
        )
        values = tensors_of(value)
        if len(values) != len(real):
            self._dirty(frame)
            return None
        if not values:
            return value
        seeds: list[torch.Tensor | None] = [None] * len(real)
        ref_grads = c.grad
        if self.grads and ref_grads is not None:
            for k, (o, g) in enumerate(zip(real, ref_grads)):
                if g is not None and o.requires_grad:
                    seeds[k] = g.to(device=o.device, dtype=o.dtype)

        def on_grads(grads: tuple[Any, ...]) -> None:
            if parent is not None and ref_grads is not None:
                parent.res.child_grad_errors.append(rep._errors(list(zip(ref_grads, grads))))

        to_caller = frame.to_caller
        if self.grads and (
            any(o.requires_grad for o in real) or any(g is not None for g in to_caller)
        ):
            box = (values, seeds, to_caller, on_grads, self._owned(values))
            *made, handle = _Exit.apply(box, *real, *frame.given)
            self.handles.append(handle)
        else:
            made = [v if own else v.clone() for v, own in zip(values, self._owned(values))]
        if in_place:
            made = write_back(frame.given, made, in_place)
        if value.__class__ is torch.Tensor:
            return made[0]
        it = iter(made)
        return map_tensors(lambda _t: next(it), value)

    def _owned(self, casts: list[torch.Tensor]) -> list[bool]:
        """Which of a call's cast values it may take without a copy: each one's first
        occurrence, where it is no longer in the cache (its last read, or a record not held in
        memory: no cache, every cast its own), and not empty."""
        last = self.casts.last if self.casts is not None else None
        seen: set[int] = set()
        out = []
        for t in casts:
            i = id(t)
            own = i not in seen and (last is None or last.get(i) is t) and t.numel() > 0
            seen.add(i)
            out.append(own)
        if last:
            last.clear()  # (what a call read and did not take, dropped: cast afresh if read again)
        return out

    def _dirty(self, frame: _Frame) -> None:
        self.out.dirty.add(frame.pos)
        live = self.rep.name_map(self.ref.calls[frame.pos].name)
        if live is not None:
            self.out.unforced.add(live)
        for f in self.stack:
            if f is not None:
                self.out.dirty.add(f.pos)
