"""``apply_checkpointing``: wrap named modules in ``torch.utils.checkpoint``, reversibly."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..core._compiled import named_modules, region_of
from ..core._errors import HookscopeError, LayerNotFoundError, enter_once
from ..core._scope import check_model
from ..core._select import suggest
from ._plan import CheckpointPlan

__all__ = ["CheckpointHandle", "apply_checkpointing"]

Kind = Literal["non_reentrant", "reentrant", "selective"]
_KINDS = ("non_reentrant", "reentrant", "selective")
_MISSING = object()


class _CheckpointedForward:
    """What replaces ``module.forward``: the class's forward run under ``checkpoint``. Holds the
    module weakly (the model is freed by reference counting alone) and is dropped by a deep copy."""

    def __init__(self, module: nn.Module, kind: str, policy: Any) -> None:
        self.ref = weakref.ref(module)
        self.kind, self.policy = kind, policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        assert module is not None
        fn = functools.partial(type(module).forward, module)
        if self.kind == "reentrant":
            if kwargs:
                raise HookscopeError(
                    f"apply_checkpointing(kind='reentrant'): {type(module).__name__} was called "
                    f"with keyword inputs {sorted(kwargs)}, which reentrant checkpointing cannot "
                    "take; use kind='non_reentrant'"
                )
            return checkpoint(fn, *args, use_reentrant=True)
        if self.kind == "selective":
            policy = self.policy
            return checkpoint(
                fn,
                *args,
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
                **kwargs,
            )
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CheckpointedForward | None:
        # the copy of the module is already in memo (deepcopy registers an object before its
        # state): the copy is checkpointed like the original, on its own weights
        twin = memo.get(id(self.ref()))
        return None if twin is None else _CheckpointedForward(twin, self.kind, self.policy)

    def __reduce__(self) -> Any:
        module = self.ref()
        raise HookscopeError(
            f"a {type(module).__name__} checkpointed by hs.apply_checkpointing cannot be pickled: "
            "call the handle's remove() first (or save the state_dict)"
        )


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
        self._undo: list[tuple[weakref.ref[nn.Module], Any]] = []
        self._closed = False

    def remove(self) -> None:
        """Undo: each module runs its own ``forward`` again."""
        self._closed = True
        undo, self._undo = self._undo, []
        for ref, saved in reversed(undo):
            module = ref()
            if module is None:
                continue
            if saved is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = saved

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
    """Wrap the modules of ``plan`` (a :class:`CheckpointPlan` or module names) in activation
    checkpointing; returns a :class:`CheckpointHandle` that undoes it.

    The module's ``forward`` is replaced on the instance (names, parameters and hooks unchanged:
    the module's own hooks run once, outside the checkpoint; hookscope's hooks inside it are exact
    under recompute). ``kind``: ``"non_reentrant"`` (``use_reentrant=False``, what a plan
    predicts), ``"reentrant"``, or ``"selective"`` with ``policy`` (ops to save, or a policy
    function, as :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` takes).

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
    names = list(plan.modules) if isinstance(plan, CheckpointPlan) else list(plan)
    check_model(model)  # indexes compiled regions
    modules = dict(named_modules(model))
    for name in names:
        if name not in modules:
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
    handle = CheckpointHandle(kind)
    for name in names:
        module = modules[name]
        if isinstance(module.__dict__.get("forward"), _CheckpointedForward):
            handle.remove()
            raise HookscopeError(
                f"apply_checkpointing: layer {name!r} is already checkpointed by another handle"
            )
        handle._undo.append((weakref.ref(module), module.__dict__.get("forward", _MISSING)))
        module.__dict__["forward"] = _CheckpointedForward(module, kind, policy)
        handle.modules.append(name)
    return handle
