"""The forward pass of :func:`hookscope.extract`: one hook per layer pools the output on the device,
casts it, starts its copy to the host without waiting and stops the pass after the last layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn

from ..core._errors import LayerNotRunError, some_names
from ..core._nested import describe, first_tensor, iter_tensors
from ..core._scope import HookScope, attribute_path, model_device
from ..core._transfer import move, ready
from ._featstore import ExtractError

__all__ = ["Pool", "Prepared", "Runner", "host", "np_dtype", "pool_fn"]

Pool = Literal["avg", "max", "flatten", "cls"] | Callable[[torch.Tensor], torch.Tensor] | None
"""How a layer's output ``(B, ...)`` becomes the saved row: ``None`` keeps it whole; ``"avg"`` /
``"max"`` reduce the spatial dims of ``(B, C, *spatial)`` (or the tokens of ``(B, T, D)``: a 3-D
output is read so, a channels-first ``(B, C, L)`` of a 1-D module too, with a warning);
``"flatten"`` gives ``(B, -1)``; ``"cls"`` keeps the first token of ``(B, T, D)``; a callable
``fn(output) -> (B, ...)`` does anything else."""

_POOLS = ("avg", "max", "flatten", "cls")


# -- pooling ------------------------------------------------------------------------------------------
def _reduce_dims(t: torch.Tensor) -> tuple[int, ...]:
    if t.dim() >= 4:
        return tuple(range(2, t.dim()))
    if t.dim() == 3:
        return (1,)
    return ()


def pool_fn(pool: Pool) -> tuple[Callable[[torch.Tensor, str], torch.Tensor], str]:
    """``(fn(output, layer) -> rows, name)`` for a ``pool`` argument."""
    if pool is None:
        return (lambda t, layer: t), "none"
    if isinstance(pool, str):
        if pool == "avg":
            return (lambda t, layer: t.mean(dim=_reduce_dims(t)) if t.dim() >= 3 else t), "avg"
        if pool == "max":
            return (lambda t, layer: t.amax(dim=_reduce_dims(t)) if t.dim() >= 3 else t), "max"
        if pool == "flatten":
            return (lambda t, layer: t.flatten(1) if t.dim() > 1 else t), "flatten"
        if pool == "cls":

            def cls(t: torch.Tensor, layer: str) -> torch.Tensor:
                if t.dim() < 3:
                    raise ExtractError(
                        f'pool="cls" keeps the first token of a (batch, tokens, dim) output, but layer '
                        f"{layer!r} gives shape {tuple(t.shape)}; use pool=None, 'flatten' or a callable"
                    )
                return t[:, 0]

            return cls, "cls"
        raise ValueError(
            f"pool must be None, one of {', '.join(map(repr, _POOLS))} or a callable; got {pool!r}"
        )
    if callable(pool):

        def custom(t: torch.Tensor, layer: str) -> torch.Tensor:
            r = pool(t)
            if not isinstance(r, torch.Tensor) or r.dim() == 0 or r.shape[0] != t.shape[0]:
                got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise ExtractError(
                    f"pool callable {getattr(pool, '__name__', pool)!r} must return a (batch, ...) tensor; "
                    f"for layer {layer!r} output {tuple(t.shape)} it returned {got}"
                )
            return r

        return (
            custom,
            f"callable:{getattr(pool, '__module__', '?')}.{getattr(pool, '__qualname__', type(pool).__name__)}",
        )
    raise ValueError(
        f"pool must be None, one of {', '.join(map(repr, _POOLS))} or a callable; got {pool!r}"
    )


def np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        raise ExtractError("numpy has no bfloat16: save features as torch.float16 or torch.float32")
    return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)


def _may_overflow(src: torch.dtype, dst: torch.dtype) -> bool:
    """A cast from ``src`` to the floating ``dst`` can turn a finite value into inf."""
    if not dst.is_floating_point or src == torch.bool:
        return False
    if src.is_floating_point:
        return torch.finfo(src).max > torch.finfo(dst).max
    if src.is_complex:
        return False  # extract saves complex layers as complex (see _saved_as)
    return torch.iinfo(src).max > torch.finfo(dst).max


# modules whose 3-D output is (batch, channels, length): pool "avg"/"max" reduces a 3-D output
# over axis 1 as the tokens of (batch, tokens, dim), which for these averages the channels
_CHANNELS_FIRST_1D = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.BatchNorm1d,
    nn.InstanceNorm1d,
    nn.MaxPool1d,
    nn.AvgPool1d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveMaxPool1d,
    nn.LPPool1d,
    nn.Dropout1d,
)


class Runner:
    """One forward pass per batch with a hook per layer: pool, cast, copy to host, stop early."""

    def __init__(
        self,
        model: nn.Module,
        named: dict[str, nn.Module],
        pool: Callable[[torch.Tensor, str], torch.Tensor],
        device: torch.device,
        pool_name: str = "",
    ) -> None:
        self.model, self.named, self.pool, self.device = model, named, pool, device
        self.pool_name = pool_name
        # the first call: {layer: (class, shape)} of a channels-first 1-D module's 3-D output
        # that pool "avg"/"max" reduces over axis 1 as tokens (said by the Job)
        self.channels_first: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.host = torch.device("cpu")
        # {layer: bool tensor}: the last call's cast to the storage dtype turned a finite value
        # into inf (float16 holds at most 65504)
        self.overflow: dict[str, Any] = {}
        # the first call looks at each layer's whole output: {layer: its tensors, described}
        # for a layer returning several, of which only the first is saved (said by the Job)
        self.watch = True
        self.dropped: dict[str, str] = {}

    def _hook(
        self, name: str, got: dict[str, Any], pending: set[str], scope: HookScope
    ) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in got:  # a module used several times: its first call counts
                return
            t = first_tensor(output)
            if t is None:
                raise ExtractError(
                    f"layer {name!r} returned {describe(output)}, which holds no tensor to save"
                )
            if self.watch and output.__class__ is not torch.Tensor:
                self._several(name, output)
            if (
                self.watch
                and t.dim() == 3
                and self.pool_name in ("avg", "max")
                and isinstance(module, _CHANNELS_FIRST_1D)
            ):
                self.channels_first[name] = (type(module).__name__, tuple(t.shape))
            f = self.pool(t, name)
            want = self.dtypes.get(name, torch.float32 if f.dtype == torch.bfloat16 else f.dtype)
            if f.dtype != want:
                cast = f.to(want)
                if _may_overflow(f.dtype, want):
                    # a finite value beyond the storage dtype's range becomes inf: flagged on the
                    # device (no sync here), checked before the batch is written
                    over = torch.isinf(cast).logical_and_(torch.isfinite(f)).any()
                    self.overflow[name] = (
                        move(over, self.host) if over.device != self.host else over
                    )
                f = cast
            pending.discard(name)
            if pending and f.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                f = f.clone()  # the rest of the forward pass may modify the activation in place
            got[name] = move(f, self.host) if f.device != self.host else f
            if not pending:
                raise scope.stop_signal()

        return hook

    def _several(self, name: str, output: Any) -> None:
        """Note a layer whose output holds other tensors than the first, which alone is saved
        (an FPN's dict of levels, a detection head's lists): ``'0': (2, 256, 25, 25), ...``."""
        seen: set[int] = set()
        parts = []
        for path, t in iter_tensors(output):
            if id(t) not in seen:
                seen.add(id(t))
                parts.append(f"{'.'.join(map(str, path)) or '<output>'!r}: {tuple(t.shape)}")
        if len(parts) > 1:
            shown = ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")
            self.dropped[name] = f"{len(parts)} tensors ({type(output).__name__}: {shown})"

    def __call__(self, data: Any) -> dict[str, Any]:
        got: dict[str, Any] = {}
        self.overflow = {}
        pending = set(self.named)
        with HookScope("extract") as scope:
            for name, module in self.named.items():
                scope.add_forward(module, self._hook(name, got, pending, scope), layer=name)
            scope.track(self.model, self.named)  # (asked only when a layer did not run)
            self._forward(data)
        if pending:
            lost = {n: v for n, v in scope.replaced_all().items() if n in pending}
            taken = sorted(n for n in scope.stripped if n in pending and n not in lost)
            if lost:
                first = next(iter(lost))
                raise LayerNotRunError(
                    f"extract: layer(s) {some_names(list(lost))} changed in the model during "
                    f"the forward pass ({lost[first]}), so the new module ran without "
                    f"extract's hook; run the model once before extract (a forward that builds "
                    f"{attribute_path(first)} builds it then), or make the change before"
                )
            if taken:
                raise LayerNotRunError(
                    f"extract: the hooks on layer(s) {some_names(taken)} were removed by "
                    "hs.remove_hooks(...) during the forward pass; do not call hs.remove_hooks "
                    "while extract runs"
                )
            raise LayerNotRunError(
                f"extract: layer(s) {', '.join(map(repr, sorted(pending)))} of {type(self.model).__name__} never "
                "ran during the forward pass (called via .forward() directly, or not on this input's path)"
            )
        return got

    def _forward(self, data: Any) -> Any:
        dev = self.device

        def to(x: Any) -> Any:
            return x.to(dev, non_blocking=True) if isinstance(x, torch.Tensor) else x

        if isinstance(data, torch.Tensor):
            return self.model(to(data))
        if isinstance(data, (tuple, list)):
            return self.model(to(data[0]))
        if isinstance(data, Mapping):
            return self.model(**{k: to(v) for k, v in data.items()})
        raise TypeError(
            f"a batch must be a tensor, a (input, ...) tuple/list or a dict of model kwargs; got {type(data).__name__}"
        )


class Prepared:
    """Eval mode (and ``device`` if given) for the run; the model's modes and device restored after."""

    def __init__(self, model: nn.Module, device: torch.device | None) -> None:
        self.model, self.device = model, device
        self.modes = [(m, m.training) for m in model.modules()]
        self.orig = model_device(model)

    def __enter__(self) -> torch.device:
        self.model.eval()
        if self.device is not None and self.device != self.orig:
            self.model.to(self.device)
            return self.device
        return self.orig

    def __exit__(self, *exc: Any) -> None:
        if self.device is not None and self.device != self.orig:
            self.model.to(self.orig)
        for m, mode in self.modes:
            m.training = mode


def host(value: Any) -> torch.Tensor:
    """A tensor returned by :class:`Runner`, once its copy to the host has finished."""
    return ready(value)
