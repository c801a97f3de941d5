"""The hooks of one logged step of :class:`~hookscope.monitor.Monitor`.

Each is a hot :class:`~hookscope.core._scope._Hook` subclass (PyTorch calls it directly, no extra
frame) holding a :class:`StepHooks`: what the hooks of one logged step share, and where they
write. Nothing here holds the monitor or the model, so the model can be freed while hooks exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core._nested import continuous, hidden_tensors, iter_tensors, real_parts
from ..core._recompute import Recomputes, in_reentrant_checkpoint
from ..core._scope import HookScope, _Hook, acts_here, get_ident, in_backward, quiet, thread_checked
from ..core._sharded import local
from ._sharded import TPLayouts
from ._stats import Scratch, Vec, act_stats, grad_stats, histogram, ranks_absmax

__all__ = [
    "EndPassHook",
    "LayerHook",
    "MarkHook",
    "PassHook",
    "ScaleHook",
    "StepHooks",
    "StepState",
]


class StepState:
    """What the hooks of one logged step write (holds no module, so nothing keeps the model alive)."""

    def __init__(self) -> None:
        # calls of each layer in the current forward pass (reset when a micro-batch starts)
        self.counts: dict[str, int] = {}
        # per layer call, one entry per micro-batch of the optimizer step
        self.acts: dict[str, list[tuple[int, Vec, torch.Tensor | None]]] = {}
        self.grads: dict[str, list[Vec]] = {}
        self.kinds: dict[str, str] = {}  # tensor parallel: "shard" / "replicate" per layer call
        self.passes = 0
        # per call of the model in progress: is it an evaluation (run under no_grad or
        # inference_mode, outside a reentrant checkpoint)? Its layer calls are not recorded.
        self.calls: list[bool] = []
        self.evaluations = 0  # calls of the model left out as evaluations this step
        self.scale: torch.Tensor | None = None
        self.scaler_states: Any = None

    def new_pass(self) -> None:
        """A micro-batch starts: layer calls are numbered from 0 again."""
        self.counts.clear()
        self.passes += 1


def _first_float(output: Any) -> torch.Tensor | None:
    return next((t for _, t in iter_tensors(output) if t.is_floating_point()), None)


def _first_value(output: Any) -> torch.Tensor | None:
    """The first floating or complex tensor of a layer's output: the one its statistics describe
    (a layer giving complex values, an FFT, had none, silently); where the output holds none in
    tuples, lists, dicts or dataclasses, the first one inside an object it returns (a
    ``Box(h)``: no row at all, silently, before)."""
    got = next((t for _, t in iter_tensors(output) if continuous(t)), None)
    if got is None and output is not None and output.__class__ is not torch.Tensor:
        inside, _ = hidden_tensors(output)
        got = next((t for t in inside if continuous(t)), None)
    return got


@dataclass(slots=True)
class StepHooks:
    """What every hook of one logged step shares: the settings, the state it writes, the scope
    (for gradient hooks on activations) and the on/off gate of :meth:`Monitor.pause`."""

    scope: HookScope
    state: StepState
    gate: list[bool]  # [False] while the monitor is paused; shared by every step's hooks
    acts: bool  # activation statistics
    grads: bool  # output-gradient statistics
    scratch: Scratch
    margin: float = 0.0  # saturation margin
    bins: int = 0  # histogram bins (0: none)
    # torch.distributed (data parallel): histograms bin over the ranks' combined range
    shared: bool = False
    scaler: Any = None
    layouts: TPLayouts | None = None  # tensor parallel: the layout of each layer's output
    # reentrant checkpointing: forward calls waiting for their recompute (docs/pitfalls.md §27)
    recomputes: Recomputes = field(default_factory=Recomputes)

    def note_scale(self) -> None:
        """Remember the GradScaler's scale of this backward (once), to report gradients unscaled."""
        state, scaler = self.state, self.scaler
        if state.scale is None and scaler is not None:
            s = getattr(scaler, "_scale", None)
            state.scale = s.detach().clone() if s is not None else torch.ones(())
            state.scaler_states = getattr(scaler, "_per_optimizer_states", None)


class _GradStats:
    """Gradient hook on a layer's output: files the gradient's statistics under the call's key."""

    __slots__ = ("hooks", "key")

    def __init__(self, hooks: StepHooks, key: str) -> None:
        self.hooks, self.key = hooks, key

    def __call__(self, g: torch.Tensor) -> None:
        self.hooks.note_scale()
        stats = grad_stats(real_parts(g if type(g) is torch.Tensor else local(g)))
        self.hooks.state.grads.setdefault(self.key, []).append(stats)


class LayerHook(_Hook):
    """Forward hook of a monitored layer: activation statistics of its first floating output, and
    a gradient hook on that output."""

    __slots__ = ("bounds", "hooks", "name")

    def __init__(self, hooks: StepHooks, name: str, bounds: tuple[float, float] | None) -> None:
        # _Hook's other fields are set by HookScope when the hook is registered
        self.fn = None  # type: ignore[assignment]
        self.hooks, self.name, self.bounds = hooks, name, bounds

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return None  # another thread's call (see acts_here)
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        h = self.hooks
        if not h.gate[0]:  # paused
            return
        if in_backward():  # activation checkpointing re-running forward
            self._recompute(output)
            return
        state = h.state
        if state.calls and state.calls[-1]:  # inside an evaluation call of the model
            return
        t = _first_value(output)
        if t is None:
            return
        name = self.name
        call = state.counts.get(name, 0)
        state.counts[name] = call + 1
        key = name if call == 0 else f"{name}#{call}"
        if h.layouts is not None:  # tensor parallel: sharded or replicated output
            state.kinds[key] = h.layouts.kind(name, module, args, t)
        if h.acts:
            x = real_parts(t if type(t) is torch.Tensor else local(t))  # DTensor: this rank's shard
            # the histogram is the first micro-batch's: later ones bin nothing
            bins = h.bins if key not in state.acts else 0
            if bins and h.shared:
                # under torch.distributed every rank bins over the combined batch's range
                # (one all_reduce per layer call), so the ranks' counts add up exactly
                v, _ = act_stats(x, self.bounds, h.margin, 0, h.scratch)
                hist = histogram(x, ranks_absmax(v), bins)
            else:
                v, hist = act_stats(x, self.bounds, h.margin, bins, h.scratch)
            state.acts.setdefault(key, []).append((x.numel(), v, hist))
        if h.grads and t.requires_grad:
            h.scope.add_activation_grad_hook(t, _GradStats(h, key), layer=name)
        elif h.grads:  # inside a reentrant checkpoint: hooked on the recompute
            h.recomputes.note(name, output, key)

    def _recompute(self, output: Any) -> None:
        """Reentrant checkpointing: the gradient flows through the recompute, so the gradient
        hook goes there, filed under the key of the first forward's call."""
        h = self.hooks
        if not (h.grads and h.recomputes.pending):
            return
        key = h.recomputes.claim(self.name, output)
        if key is not None:
            t = _first_value(output)
            if t is not None and t.requires_grad:
                h.scope.add_activation_grad_hook(t, _GradStats(h, key), layer=self.name)


class MarkHook(_Hook):
    """Forward hook of a module a tensor-parallel plan names, outside the monitored layers: it
    marks its output's layout (sharded or replicated) for the layers after it."""

    __slots__ = ("hooks", "name")

    def __init__(self, hooks: StepHooks, name: str) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks, self.name = hooks, name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        h = self.hooks
        if in_backward() or not h.gate[0] or h.layouts is None:
            return
        t = _first_float(output)
        if t is not None:
            h.layouts.kind(self.name, module, args, t)


class PassHook(_Hook):
    """Forward pre-hook of the model: each call starts a micro-batch (as ``Monitor.micro_batch``,
    which this hook cannot call: it holds no reference to the monitor or the model)."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: StepHooks) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks = hooks

    @thread_checked
    def __call__(self, module: nn.Module, args: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return None  # another thread's call (see acts_here)
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        h, state = self.hooks, self.hooks.state
        if in_backward():
            state.calls.append(False)
            return None
        # A call under no_grad or inference_mode (an evaluation inside the step) trains
        # nothing: it is no micro-batch, and its layer calls are not recorded (they were added
        # to the training batch's statistics, silently). The first forward of a reentrant
        # checkpoint of the whole model also runs under no_grad: that one is training.
        evaluation = not torch.is_grad_enabled() and not in_reentrant_checkpoint()
        state.calls.append(evaluation)
        if not h.gate[0]:
            return None
        if evaluation:
            state.evaluations += 1
            return None
        state.new_pass()
        if h.layouts is not None:
            h.layouts.reset()
        return None


class EndPassHook(_Hook):
    """Forward hook (``always_call``) of the model: the call :class:`PassHook` opened ends."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: StepHooks) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks = hooks

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return None  # another thread's call (see acts_here)
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        calls = self.hooks.state.calls
        if calls:
            calls.pop()
        return None


class ScaleHook(_Hook):
    """Post-accumulate-grad hook of a parameter: notes the GradScaler's scale of this backward."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: StepHooks) -> None:
        self.fn = None  # type: ignore[assignment]
        self.hooks = hooks

    def __call__(self, param: torch.Tensor) -> None:
        self.hooks.note_scale()
