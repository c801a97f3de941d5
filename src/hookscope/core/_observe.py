"""``observe`` and ``tensor_grads``: call a function on every layer call, or collect tensor grads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from ._capture import Call, Inputs
from ._errors import HookscopeError, NoGradientError
from ._nested import iter_tensors, map_tensors
from ._scope import HookScope, check_model, warn_lost
from ._select import resolve

__all__ = ["TensorGrads", "observe", "tensor_grads"]


def observe(model: nn.Module, layers: Any, fn: Callable[[Call], Any]) -> HookScope:
    """Call ``fn(call)`` after every call of the selected layers, while the scope is active.

    ``call`` is a :class:`Call` holding the layer name, call index, inputs and output. The output
    is the layer's own tensor (not detached, not copied: ``fn`` can register a gradient hook on
    it), and while ``fn`` runs it is exactly what the layer returned. To keep it, keep a copy
    (``call.output.detach().clone()``) or use :func:`capture`: reading ``call.output`` after the
    model changed it in place raises an :class:`InPlaceModifiedWarning`. The inputs are detached
    copies taken before the layer ran, so they are what it received even when it changes its
    input in place (``ReLU(inplace=True)``). ``fn``'s return value is ignored, so
    ``lambda c: c.output.register_hook(f)`` (which returns a handle) cannot replace the output by
    accident (docs/pitfalls.md §11); use :func:`edit` to change values.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> seen = []
        >>> with hs.observe(net, "*", lambda c: seen.append((c.layer, tuple(c.output.shape)))):
        ...     _ = net(torch.zeros(4, 2))
        >>> seen
        [('0', (4, 3)), ('1', (4, 3))]
    """
    check_model(model)
    named = resolve(model, layers)
    if not callable(fn):
        raise TypeError(
            f"observe: fn must be a function fn(call) called after each call; got {type(fn).__name__}"
        )
    scope = HookScope("observe")
    counts: dict[str, int] = {}

    def snapshot(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    for name, module in named.items():
        received: list[Inputs] = []

        def pre(
            module: nn.Module, args: Any, kwargs: Any, received: list[Inputs] = received
        ) -> None:
            received.append(
                Inputs(map_tensors(snapshot, tuple(args)), map_tensors(snapshot, dict(kwargs)))
            )

        def hook(
            module: nn.Module,
            args: Any,
            kwargs: Any,
            output: Any,
            name: str = name,
            received: list[Inputs] = received,
        ) -> None:
            if not received:
                return
            inputs = received.pop()
            index = counts.get(name, 0)
            counts[name] = index + 1
            call = Call(name, index)
            call._output = output
            call._versions = [
                (t, t._version) for _, t in iter_tensors(output) if not t.is_inference()
            ]
            call.inputs = inputs
            fn(call)  # return value deliberately ignored

        scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
        scope.add_forward(module, hook, layer=name, with_kwargs=True)
    # a layer replaced while open, or hooks hs.remove_hooks took: fn missed its calls (warned)
    # (names only: the scope holds no module, so the model is freed by reference counting)
    scope.track(model, named)
    names = tuple(named)
    scope.watch_unrouted(model, names, "observed")
    scope.on_remove(
        lambda: warn_lost(scope, names, "observe", "observed", {n: counts.get(n, 0) for n in names})
    )
    return scope


class TensorGrads(Sequence[torch.Tensor]):
    """Gradients of given tensors, collected by :func:`tensor_grads` (index like the arguments)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._scope = HookScope("tensor_grads")
        self._grads: list[torch.Tensor | None] = [None] * len(tensors)
        # arguments that are sharded parameters (a DTensor: FSDP2's): their own hooks never run
        self._sharded: set[int] = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor_grads takes tensors; argument {i} is {type(t).__name__}")
            if not t.requires_grad:
                raise HookscopeError(
                    f"tensor_grads: argument {i} does not require grad, so it never gets a gradient"
                )
            if _is_dtensor(t) and t.is_leaf:
                self._sharded.add(i)
            self._scope.add_activation_grad_hook(t, self._recorder(i), layer=f"<tensor {i}>")

    def _recorder(self, i: int) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            g = grad.detach()
            prev = self._grads[i]
            # a copy: autograd's buffer becomes a leaf's .grad, changed in place later (see _GradSlots)
            self._grads[i] = g.clone() if prev is None else prev + g

        return record

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        g = self._grads[i]
        if g is None:
            if i in self._sharded:
                raise NoGradientError(
                    f"no gradient reached tensor {i}: it is a sharded parameter (a DTensor, as "
                    "FSDP2's fully_shard makes), whose own gradient hooks never run: FSDP2 "
                    "computes the gradient of the unsharded parameter and reduces it into its "
                    ".grad; read p.grad after backward, or use hs.edit_grads / hs.clip_grads "
                    "on the parameter's name"
                )
            raise NoGradientError(
                f"no gradient reached tensor {i}: backward() has not run, or it is not part of the loss"
            )
        return g

    def __len__(self) -> int:
        return len(self._grads)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def __enter__(self) -> TensorGrads:
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.remove()

    def remove(self) -> None:
        """Stop collecting (recorded gradients stay readable)."""
        self._scope.remove()


def tensor_grads(*tensors: torch.Tensor) -> TensorGrads:
    """Collect the gradients of any tensors (non-leaf too) without ``retain_grad()``.

    A tensor's gradient is what its own backward computes: for a parameter under
    ``DistributedDataParallel``, this rank's gradient before DDP averages the ranks' into
    ``.grad`` (read ``p.grad`` after backward for that); a parameter sharded by FSDP2 gets none
    (its hooks never run: the read says so).

    Example:
        >>> import torch, hookscope as hs
        >>> a = torch.ones(3, requires_grad=True)
        >>> b = 2 * a
        >>> with hs.tensor_grads(b) as g:
        ...     b.mean().backward()
        >>> g[0].tolist()
        [0.3333333432674408, 0.3333333432674408, 0.3333333432674408]
    """
    return TensorGrads(tensors)


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (without importing torch.distributed where it is not)."""
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)
