"""``apply_checkpointing``: wrap named modules in ``torch.utils.checkpoint``, reversibly."""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..core._compiled import named_modules, region_of
from ..core._errors import HookscopeError, LayerNotFoundError, enter_once
from ..core._nested import iter_tensors
from ..core._scope import check_model
from ..core._select import suggest
from ._plan import CheckpointPlan
from ._replay import CallState, ModuleMemory

__all__ = ["CheckpointHandle", "apply_checkpointing"]

Kind = Literal["non_reentrant", "reentrant", "selective"]
_KINDS = ("non_reentrant", "reentrant", "selective")
_MISSING = object()


class _CheckpointedForward:
    """What replaces ``module.forward``: the module's forward run under ``checkpoint``, each call
    with a :class:`~hookscope.memory._replay.CallState` so that its recompute replays the call
    (buffers, attributes, caches, random numbers) and changes nothing. Holds the module weakly
    (the model is freed by reference counting alone)."""

    def __init__(
        self, module: nn.Module, name: str, kind: str, policy: Any, inner: Any = None
    ) -> None:
        self.ref = weakref.ref(module)
        self.kind, self.policy = kind, policy
        self.inner = inner  # an instance ``forward`` it replaced (None: the class's)
        self.memory = ModuleMemory(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        assert module is not None
        fn = self.inner or functools.partial(type(module).forward, module)
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            # no backward (nothing recomputed), or traced by Dynamo (the compiled graph replays
            # the region functionally)
            return self._checkpoint(module, fn, args, kwargs)
        state = CallState(module, self.memory, fn, args, kwargs)
        out = self._checkpoint(module, state.run, args, kwargs, caches=bool(state.caches))
        state.check_inputs("by its own forward")
        state.after_call()
        return out

    def _checkpoint(
        self,
        module: nn.Module,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        caches: bool = False,
    ) -> Any:
        # every tensor of the call is given to ``checkpoint`` as a positional input: it saves
        # those through the saved-tensor hooks (a memory_profile of the checkpointed model counts
        # them; save_on_cpu moves them), and reentrant checkpointing gives only those gradients
        # (a tensor inside a tuple would be cut from the graph: None gradients before it)
        flat_fn, tensors = _flat(fn, args, kwargs)
        if self.kind == "reentrant" and _needs_grad(args):
            if kwargs or caches:
                what = "a key/value cache" if caches else f"keyword inputs {sorted(kwargs)}"
                raise HookscopeError(
                    f"apply_checkpointing(kind='reentrant'): layer {self.memory.name!r} "
                    f"({type(module).__name__}) was called with {what}, which reentrant "
                    "checkpointing cannot take; use kind='non_reentrant'"
                )
            return checkpoint(flat_fn, *tensors, use_reentrant=True)
        # (reentrant checkpointing of a call whose inputs need no gradient would leave the
        # module's parameter gradients None: such a call is checkpointed non-reentrant)
        if self.kind == "selective":
            if caches:  # its recompute replays the call's operations one for one
                raise HookscopeError(
                    f"apply_checkpointing(kind='selective'): layer {self.memory.name!r} was "
                    "called with a key/value cache, whose recompute runs with the cache off and "
                    "so differs from the call operation for operation; train with "
                    "use_cache=False, or use kind='non_reentrant'"
                )
            policy = self.policy
            return checkpoint(
                flat_fn,
                *tensors,
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
            )
        return checkpoint(flat_fn, *tensors, use_reentrant=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # reached only when the wrapper itself is copied (a module's copy drops it, see
        # _PlainState): the forward it replaced, or nothing
        return copy.deepcopy(self.inner, memo)

    def __reduce__(self) -> Any:
        raise HookscopeError(
            f"the checkpointing wrapper of layer {self.memory.name!r} cannot be pickled on its "
            "own; pickle the model (its copy is not checkpointed) or call the handle's remove()"
        )


def _flat(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[Any]]:
    """``fn`` as a function of the call's tensors alone (those in nested tuples, lists, dicts
    and keyword inputs included), and those tensors; the rest of the call is kept as it is."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def flat_fn(*tensors: Any) -> Any:
        now = list(leaves)
        for i, t in zip(where, tensors):
            now[i] = t
        a, k = tree_unflatten(now, spec)
        return fn(*a, **k)

    return flat_fn, [leaves[i] for i in where]


def _needs_grad(args: tuple[Any, ...]) -> bool:
    return any(t.requires_grad for _, t in iter_tensors(args))


class _PlainState:
    """Put in a checkpointed module's ``__dict__`` as ``__getstate__``: a deep copy, a
    ``copy.copy`` or a pickle of the module (``torch.save``) gets the module without the
    checkpointing wrapper (with the ``forward`` it replaced, if any). Holds the module weakly."""

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.ref, self.inner = weakref.ref(module), inner

    def __call__(self) -> Any:
        module = self.ref()
        assert module is not None
        own = type(module).__getstate__
        state = own(module)
        d, rest = (state, None) if isinstance(state, dict) else state
        d = dict(d)
        d.pop("__getstate__", None)
        if self.inner is None:
            d.pop("forward", None)
        else:
            d["forward"] = self.inner
        return d if rest is None and isinstance(state, dict) else (d, rest)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> Any:
        return (type(None), ())


class CheckpointHandle:
    """What :func:`apply_checkpointing` returns: ``remove()`` (idempotent) or ``with`` exit puts
    each module's ``forward`` back.

    Attributes:
        modules: the checkpointed module names.
        kind: the checkpoint kind.

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> handle = hs.apply_checkpointing(net, ["1"])
        >>> handle
        <CheckpointHandle non_reentrant active: ['1']>
        >>> handle.remove(); "forward" in net[1].__dict__
        False
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.modules: list[str] = []
        self._undo: list[tuple[weakref.ref[nn.Module], dict[str, Any]]] = []
        self._closed = False

    def remove(self) -> None:
        """Undo: each module runs its own ``forward`` again."""
        self._closed = True
        undo, self._undo = self._undo, []
        for ref, saved in reversed(undo):
            module = ref()
            if module is None:
                continue
            for key, value in saved.items():
                if value is _MISSING:
                    module.__dict__.pop(key, None)
                else:
                    module.__dict__[key] = value

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def __enter__(self) -> CheckpointHandle:
        enter_once(self, "apply_checkpointing", not self._closed)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<CheckpointHandle {self.kind} {state}: {self.modules}>"


def apply_checkpointing(
    model: nn.Module,
    plan: CheckpointPlan | Sequence[str],
    *,
    kind: Kind = "non_reentrant",
    policy: Sequence[Any] | Callable[..., Any] | None = None,
) -> CheckpointHandle:
    """Wrap the modules of ``plan`` (a :class:`CheckpointPlan`, module names, or one name) in
    activation checkpointing; returns a :class:`CheckpointHandle` that undoes it.

    The module's ``forward`` is replaced on the instance (names, parameters and hooks unchanged:
    the module's own hooks run once, outside the checkpoint; hookscope's hooks inside it are exact
    under recompute; a ``forward`` already set on the instance is the one checkpointed).
    ``kind``: ``"non_reentrant"`` (``use_reentrant=False``, what a plan predicts),
    ``"reentrant"``, or ``"selective"`` with ``policy`` (ops to save, or a policy function, as
    :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` takes).

    A training step under it gives the gradients, buffers and outputs of the step without it.
    The recompute in backward replays each call: buffers the forward updates (BatchNorm's
    running statistics, found by the run) change once, from the values at the call; plain
    attributes (a counter, ``training``) are those of the call; a Hugging Face key/value cache
    is off in the recompute (``use_cache=True`` works; a cache that already holds the layer's
    positions, or any cache under ``kind="selective"``, is refused); random generators are
    restored. A module that changes its input in
    place (``ReLU(inplace=True)``, or found in the run) is refused by name, and a recompute
    whose input was changed in place after the call raises. With ``kind="reentrant"``, a call
    whose inputs need no gradient is checkpointed non-reentrant (reentrant checkpointing would
    leave its parameters without gradients). A copy (``copy.deepcopy``) or a pickle
    (``torch.save``) of the model is the plain model. See the guide (docs/guide/memory.md).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> tanhs = nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Tanh())
        >>> net = nn.Sequential(nn.Linear(4, 8), tanhs, nn.Linear(8, 1))
        >>> x = torch.randn(2, 4)
        >>> prof = hs.memory_profile(net, x)
        >>> plan = prof.plan(budget_bytes=200)
        >>> prof.total_saved_bytes, plan.modules, plan.predicted_drop
        (224, ['1.1'], 64)
        >>> with hs.apply_checkpointing(net, plan):
        ...     hs.memory_profile(net, x).total_saved_bytes
        160
    """
    if kind not in _KINDS:
        raise ValueError(f"apply_checkpointing: kind must be one of {_KINDS}, got {kind!r}")
    if kind == "selective" and policy is None:
        raise ValueError(
            "apply_checkpointing(kind='selective') needs policy=: a list of ops to save (e.g. "
            "[torch.ops.aten.mm.default]) or a policy function"
        )
    names = _names(plan)
    check_model(model)  # indexes compiled regions
    modules = dict(named_modules(model))
    for name in names:
        if name not in modules:
            same = _alias_of(model, name, modules)
            if same is not None:
                raise LayerNotFoundError(
                    f"apply_checkpointing: {name!r} is the module {same!r} (one module registered "
                    f"under both names; PyTorch lists it once, as {same!r}): name {same!r}, which "
                    "checkpoints every call of it"
                )
            raise LayerNotFoundError(
                f"apply_checkpointing: no module {name!r} in {type(model).__name__}; closest: "
                + ", ".join(repr(n) for n in suggest(name, list(modules)))
            )
        if region_of(modules[name]) is not None:
            raise HookscopeError(
                f"apply_checkpointing: layer {name!r} is inside a torch.compile'd region, whose "
                "compiled graph would not see the change; apply checkpointing to the model "
                "before compiling it (torch.compile(model) after hs.apply_checkpointing)"
            )
        if not name:
            raise HookscopeError(
                "apply_checkpointing: the model itself ('') cannot be checkpointed (nothing would "
                "be saved outside it to start the recompute from); name its submodules"
            )
        if getattr(modules[name], "inplace", False) is True:
            raise HookscopeError(
                f"apply_checkpointing: layer {name!r} ({type(modules[name]).__name__}"
                "(inplace=True)) changes its input in place, so its recompute in backward would "
                "start from the changed value; checkpoint the block that contains it instead"
            )
        if isinstance(modules[name].__dict__.get("forward"), _CheckpointedForward):
            raise HookscopeError(
                f"apply_checkpointing: layer {name!r} is already checkpointed by another handle"
            )
    handle = CheckpointHandle(kind)
    for name in names:
        module = modules[name]
        d = module.__dict__
        saved = {key: d.get(key, _MISSING) for key in ("forward", "__getstate__")}
        handle._undo.append((weakref.ref(module), saved))
        inner = None if saved["forward"] is _MISSING else saved["forward"]
        d["forward"] = _CheckpointedForward(module, name, kind, policy, inner)
        d["__getstate__"] = _PlainState(module, inner)
        handle.modules.append(name)
    return handle


def _alias_of(model: nn.Module, name: str, modules: dict[str, nn.Module]) -> str | None:
    """The name ``modules`` lists for the module at ``name`` (a tied module registered twice)."""
    try:
        module = model.get_submodule(name)
    except (AttributeError, ValueError):
        return None
    return next((n for n, m in modules.items() if m is module), None)


def _names(plan: Any) -> list[str]:
    """Module names from a plan, a list of names or one name."""
    if isinstance(plan, CheckpointPlan):
        return list(plan.modules)
    if isinstance(plan, str):
        return [plan]  # one name (not its characters)
    if not isinstance(plan, (list, tuple)) or not all(isinstance(n, str) for n in plan):
        raise TypeError(
            "apply_checkpointing: plan must be a CheckpointPlan (MemoryProfile.plan), a module "
            f"name or a list of module names, got {type(plan).__name__} {plan!r:.60}"
        )
    if not plan:
        raise ValueError(
            "apply_checkpointing: the list of module names is empty; name the modules to "
            "checkpoint, or pass a plan (MemoryProfile.plan(budget_bytes))"
        )
    dup = sorted({n for n in plan if plan.count(n) > 1})
    if dup:
        raise ValueError(f"apply_checkpointing: module names given twice: {dup}")
    return list(plan)
