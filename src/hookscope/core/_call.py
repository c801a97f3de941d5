"""Call records: what :func:`capture` keeps for each call of a layer (output, inputs, gradients)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from ._errors import HookscopeError, InPlaceModifiedWarning, LayerNotRunError, NoGradientError
from ._nested import map_tensors
from ._transfer import move, ready

__all__ = ["Call", "Inputs"]


class Inputs(NamedTuple):
    """Positional and keyword inputs of one call."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _nograd_reason() -> str:
    if torch.is_inference_mode_enabled():
        return "the forward pass ran under torch.inference_mode()"
    if not torch.is_grad_enabled():
        return "the forward pass ran under torch.no_grad()"
    return "no tensor in it required grad (no input or parameter upstream requires grad)"


class _GradSlots:
    """Gradients for the tensor leaves of one captured value (accumulated over backward passes)."""

    __slots__ = ("grads", "n", "reason")

    def __init__(self, n: int, reason: str | None) -> None:
        self.n, self.reason = n, reason
        self.grads: list[torch.Tensor | None] = [None] * n

    def hook(self, i: int, to: torch.device | None) -> Any:
        def record(grad: torch.Tensor) -> None:
            prev = self.grads[i]
            g = grad.detach()
            if to is not None and g.device != to:
                g = ready(move(g, to))  # a copy
            elif prev is None:
                # a copy: the gradient a hook is handed is autograd's buffer, which AccumulateGrad
                # adopts as a leaf's .grad when it flows there unchanged (the input of a first
                # layer); a later zero_grad(set_to_none=False) or backward changes it in place
                g = g.clone()
            self.grads[i] = g if prev is None else prev + g
            return None

        return record

    def build(self, like: Any, what: str) -> Any:
        if all(g is None for g in self.grads):
            reason = (
                self.reason
                or "backward() has not reached it yet, or it does not contribute to the loss"
            )
            raise NoGradientError(f"no gradient for {what}: {reason}")
        it = iter(self.grads)
        return map_tensors(lambda _t: next(it), like, other=lambda _x: None)


_functorch: Any = getattr(torch._C, "_functorch", None)
_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)


def _outside_transform(value: Any, what: str, layer: str, index: int) -> Any:
    """``value`` as read after the ``torch.func`` transform it was recorded in ended.

    A layer run inside ``torch.func.grad``/``vjp``/``vmap``/``jacrev``/... hands its hooks the
    transform's wrapper tensors. A gradient-tracking wrapper holds the layer's exact values: it
    is unwrapped. A ``vmap`` wrapper (``BatchedTensor``) holds one sample's view of a batch (its
    shape lacks the vmapped dimension) and means nothing once its ``vmap`` ended: reading it
    raises, naming the layer. Read inside the transformed function, wrappers are left as they
    are (that is where they mean something: ``hs.FeatureExtractor`` under ``vmap``).
    """
    if _wrapped is None:
        return value
    if value.__class__ is torch.Tensor and not _wrapped(value):
        return value  # the common case: one call
    level = _functorch.maybe_current_level()
    dead = _functorch.is_dead_tensor_wrapper

    def one(t: torch.Tensor) -> torch.Tensor:
        while _wrapped(t) and (level is None or dead(t)):
            if _functorch.is_batchedtensor(t) or _functorch.is_legacy_batchedtensor(t):
                raise HookscopeError(
                    f"the {what} of {layer!r} (call {index}) was recorded inside torch.func.vmap "
                    "(also used by jacrev, jacfwd, hessian): it is vmap's per-sample wrapper "
                    "(its shape lacks the vmapped dimension), which means nothing after vmap "
                    "ended. Read it inside the vmapped function (hs.FeatureExtractor returns "
                    "outputs from there), or run the model outside the transform"
                )
            t = _functorch.get_unwrapped(t)
        return t

    return map_tensors(one, value)


def _check_versions(
    versions: list[tuple[torch.Tensor, int]] | None, what: str, layer: str, index: int
) -> None:
    """Warn when a tensor kept without a copy was changed in place after it was recorded."""
    if versions:
        for t, v in versions:
            if t._version != v:
                warnings.warn(
                    f"the {what} of {layer!r} (call {index}) was modified in place after it was "
                    "recorded (e.g. by a later ReLU(inplace=True) or `out += identity`), and it was "
                    "kept without a copy (clone=False), so you see the modified values. Leave "
                    "clone=True (the default) to keep the values the layer produced",
                    InPlaceModifiedWarning,
                    stacklevel=4,
                )
                return


class Call:
    """One call of a captured layer.

    Values are what the layer returned and received, even when the model changes those tensors in
    place later (they are copies), unless captured with ``clone=False``: then they are the model's
    own tensors (zero-copy), and reading one that was changed in place since raises an
    :class:`InPlaceModifiedWarning`.

    Attributes:
        layer: the layer's dotted name.
        index: 0 for the layer's first call in the scope, 1 for the second, ...
        output: the output (nested structure kept), detached unless ``detach=False``.
        inputs: :class:`Inputs` when captured with ``inputs=True``, else ``None``.
    """

    __slots__ = (
        "_grad",
        "_in_grad",
        "_in_versions",
        "_in_views",
        "_inputs",
        "_output",
        "_versions",
        "index",
        "layer",
    )

    def __init__(self, layer: str, index: int) -> None:
        self.layer, self.index = layer, index
        self._output: Any = _UNSET
        self._inputs: Inputs | None = None
        self._grad: _GradSlots | None = None
        self._in_grad: _GradSlots | None = None
        self._versions: list[tuple[torch.Tensor, int]] | None = None
        self._in_versions: list[tuple[torch.Tensor, int]] | None = None
        # the identity views the layer got (and their versions), checked when it ends
        self._in_views: list[tuple[torch.Tensor, int]] | None = None

    @property
    def output(self) -> Any:
        if self._output is _UNSET:
            raise LayerNotRunError(
                f"layer {self.layer!r} call {self.index} raised before returning an output"
            )
        _check_versions(self._versions, "output", self.layer, self.index)
        out = (
            map_tensors(ready, self._output)
            if self._output.__class__ is not torch.Tensor
            else self._output
        )
        return _outside_transform(out, "output", self.layer, self.index)

    @property
    def inputs(self) -> Inputs | None:
        _check_versions(self._in_versions, "inputs", self.layer, self.index)
        if self._inputs is None:
            return None
        return _outside_transform(self._inputs, "inputs", self.layer, self.index)

    @inputs.setter
    def inputs(self, value: Inputs | None) -> None:
        self._inputs = value

    @property
    def grad(self) -> Any:
        """Gradient of the loss w.r.t. this call's output (same structure, ``None`` for leaves without one)."""
        if self._grad is None:
            raise NoGradientError(
                f"gradients of {self.layer!r} were not captured; use capture(..., grads=True)"
            )
        g = self._grad.build(self._output, f"the output of {self.layer!r} (call {self.index})")
        return _outside_transform(g, "output gradient", self.layer, self.index)

    @property
    def input_grad(self) -> Inputs:
        """Gradient w.r.t. this call's inputs (through this layer only), as :class:`Inputs`."""
        if self._in_grad is None or self._inputs is None:
            raise NoGradientError(
                f"input gradients of {self.layer!r} were not captured; use capture(..., inputs=True, grads=True)"
            )
        g = self._in_grad.build(
            (self._raw_inputs_structure()), f"the inputs of {self.layer!r} (call {self.index})"
        )
        g = _outside_transform(g, "input gradient", self.layer, self.index)
        return Inputs(tuple(g[0]), dict(g[1]))

    def _raw_inputs_structure(self) -> tuple[Any, Any]:
        assert self._inputs is not None
        return (self._inputs.args, self._inputs.kwargs)

    def __repr__(self) -> str:
        from ._nested import describe

        out = "?" if self._output is _UNSET else describe(self._output)
        return f"Call({self.layer!r}, index={self.index}, output={out})"


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
