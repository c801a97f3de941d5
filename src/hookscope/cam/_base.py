"""The CAM template: one forward (and a backward through the layers after the target only), then
batched, on-device post-processing. Each method (``_methods.py``) is a small subclass that
says how to turn a layer's activation and gradient into a map; the registry maps names to them.

How the gradient is taken cheaply: the model runs with autograd *off* until the target layer. A
forward hook on that layer turns autograd on, makes the layer's output a fresh leaf (detached,
``requires_grad_()``) and passes a copy of it on. So autograd records only the part of the network
after the layer, ``torch.autograd.grad(score, leaf)`` runs backward through that part only, and no
parameter ever gets a ``.grad``. The leaf itself is never handed to the model, so a later in-place
op (``ReLU(inplace=True)``, ``out += identity``) cannot change the activation we read, and its
gradient is the one of the out-of-place model (docs/pitfalls.md §3).
"""

from __future__ import annotations

import difflib
import numbers
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core._buffers import state_kept
from ..core._compiled import named_modules
from ..core._errors import HookscopeError, HookscopeWarning, some_names
from ..core._nested import describe, first_tensor, iter_tensors, replace_first, tensors_of
from ..core._random import draw_fix, draw_place, random_draws
from ..core._scope import HookScope, check_model, in_backward, internal_run, stale_names
from ..core._select import resolve
from ._tokens import Reshape, ReshapeError, to_grid

__all__ = ["CAM", "CAMError", "Target", "cam_methods", "get_cam"]

Target = int | Sequence[int] | torch.Tensor | Callable[[Any], torch.Tensor] | None
"""A class index, one index per sample (list or 1-D tensor), ``None`` (each sample's predicted
class), or ``fn(model_output) -> scores``: one score per sample (or any tensor, summed)."""

_REGISTRY: dict[str, type[CAM]] = {}


class CAMError(HookscopeError):
    """A CAM cannot be computed as asked (bad target, layer without a map, no gradient, ...)."""


def _key(name: str) -> str:
    return name.lower().replace("++", "pp").replace("-", "").replace("_", "").replace(" ", "")


def cam_methods() -> dict[str, type[CAM]]:
    """The registered CAM methods, ``{name: class}`` (e.g. ``"gradcam"``, ``"gradcam++"``).

    Example:
        >>> import hookscope as hs
        >>> sorted(hs.cam_methods())[:3]
        ['eigencam', 'gradcam', 'gradcam++']
    """
    return dict(_REGISTRY)


def get_cam(name: str) -> type[CAM]:
    """The CAM class registered as ``name`` (case, ``-``, ``_`` and ``++``/``pp`` are forgiven).

    Example:
        >>> import hookscope as hs
        >>> hs.get_cam("Grad-CAM++").__name__
        'GradCAMPlusPlus'
    """
    by_key = {_key(n): cls for n, cls in _REGISTRY.items()}
    by_key.update({_key(a): cls for cls in _REGISTRY.values() for a in cls.aliases})
    cls = by_key.get(_key(name))
    if cls is None:
        close = difflib.get_close_matches(name.lower(), list(_REGISTRY), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise CAMError(
            f"unknown CAM method {name!r}{hint} Available: {', '.join(sorted(_REGISTRY))}"
        )
    return cls


def _logits(out: Any) -> torch.Tensor:
    """The class scores in a model's output: the output itself, the tensor named ``logits`` (a
    dict or a Hugging Face output) or ``out`` (torchvision's segmentation models), or the one
    floating tensor of a tuple. Several floating tensors and none of those names are refused:
    the first of ``(features, logits)`` was taken for the logits, silently."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        for name in ("logits", "out"):
            if isinstance(out.get(name), torch.Tensor):
                return out[name]
    lg = getattr(out, "logits", None)
    if isinstance(lg, torch.Tensor):
        return lg
    found = [(path, t) for path, t in iter_tensors(out) if t.is_floating_point()]
    if len(found) > 1:
        listed = ", ".join(
            "out" + "".join(f"[{p!r}]" for p in path) + f" {tuple(t.shape)}"
            for path, t in found[:4]
        ) + (", ..." if len(found) > 4 else "")
        raise CAMError(
            f"the model returned {len(found)} floating tensors ({type(out).__name__}: {listed}) "
            "and none named 'logits' (or 'out'), so a class index cannot tell which one holds "
            "the class scores; pass target=fn(output) -> scores, e.g. "
            "target=lambda out: out[1][:, class_index] for the second"
        )
    if found:
        return found[0][1]
    t = first_tensor(out)
    if t is None:
        raise CAMError(
            f"the model returned no tensor ({type(out).__name__}); pass target=fn(output) -> scores"
        )
    return t


def _minmax(m: torch.Tensor) -> torch.Tensor:
    """Per-sample ``(m - min) / (max + 1e-7)``, as pytorch-grad-cam's ``scale_cam_image``."""
    dims = tuple(range(1, m.ndim))
    m = m - m.amin(dim=dims, keepdim=True)
    return m / (1e-7 + m.amax(dim=dims, keepdim=True))


_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _aliases(t: torch.Tensor, args: Any, kwargs: Any) -> bool:
    """Does ``t`` share memory with a tensor among a layer call's inputs?"""
    try:
        ptr = t.untyped_storage().data_ptr()
        return any(
            i.untyped_storage().data_ptr() == ptr for i in (*tensors_of(args), *tensors_of(kwargs))
        )
    except (RuntimeError, NotImplementedError):  # no storage (sparse, meta, some subclasses)
        return True  # copy to be safe


def _scalar(t: Any) -> bool:
    return not isinstance(t, (Sequence, torch.Tensor)) and not hasattr(t, "__len__")


def _class_index(v: Any) -> int:
    """``v`` as a class index: an integer (Python, NumPy, 0-d integer tensor), never a bool or a
    float (``int(2.7)`` read class 2, silently)."""
    if not isinstance(v, (bool, numbers.Real)) and not isinstance(v, torch.Tensor):
        kind = type(v).__name__
    elif isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
        kind = "bool"
    else:
        try:
            return operator.index(v)
        except TypeError:
            kind = type(v).__name__ if not isinstance(v, torch.Tensor) else str(v.dtype)
    raise CAMError(
        f"target: class indices must be integers, got {v!r} ({kind}); pass an int, a list of "
        "ints, an integer tensor, or target=fn(output) -> scores"
    )


class _Run:
    """What one call knows: the input, the class indices (if any) and how to score an output."""

    def __init__(self, cam: CAM, x: torch.Tensor, target: Target) -> None:
        self.cam, self.model, self.x, self.target = cam, cam.model, x, target
        self.index: torch.Tensor | None = None  # (B,) class per sample, on x's device

    def resolve_target(self, out: Any) -> None:
        """Turn ``target`` into per-sample class indices on the output's device (no host sync)."""
        t, b = self.target, self.x.shape[0]
        if callable(t):
            return
        logits = _logits(out)
        if t is None:
            if logits.ndim != 2:
                raise CAMError(
                    f"target=None means each sample's predicted class, which needs (B, num_classes) "
                    f"logits; the model gives {describe(out)}. Pass target=class_index or target=fn(output) -> scores"
                )
            self.index = logits.detach().argmax(dim=1)
            return
        if isinstance(t, torch.Tensor):
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                # .long() truncated 2.7 to class 2 and read a mask [True, False] as classes 1, 0
                raise CAMError(
                    f"target: class indices must be an integer tensor, got {t.dtype} "
                    f"{tuple(t.shape)}; pass target=indices.long() (rounded as you mean) or "
                    "target=fn(output) -> scores"
                )
            idx = t.to(device=logits.device, dtype=torch.long).reshape(-1)
            if idx.numel() == 1:
                idx = idx.expand(b)
        else:
            vals = [_class_index(t)] * b if _scalar(t) else [_class_index(v) for v in t]  # type: ignore[union-attr]
            k = logits.shape[1] if logits.ndim >= 2 else 0
            bad = [v for v in vals if not 0 <= v < k]
            if bad:
                raise CAMError(
                    f"target: class {bad[0]} out of range; the model gives {describe(out)} ({k} classes)"
                )
            idx = torch.tensor(vals, dtype=torch.long).to(logits.device, non_blocking=True)
        if idx.shape[0] != b:
            raise CAMError(f"target: {idx.shape[0]} targets for a batch of {b}")
        self.index = idx

    def score(self, out: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row scores of ``out``; ``rows`` picks each row's class index (default: the batch's)."""
        if callable(self.target):
            s = self.target(out)
            if not isinstance(s, torch.Tensor):
                raise CAMError(
                    f"target function returned {type(s).__name__}; it must return a tensor of scores"
                )
            return s
        logits = _logits(out)
        idx = self.index if rows is None else rows
        assert idx is not None
        if logits.ndim < 2:
            raise CAMError(
                f"class-index targets need (B, num_classes, ...) outputs; got {describe(out)}"
            )
        picked = logits.flatten(2) if logits.ndim > 2 else logits.unsqueeze(2)
        return picked.gather(1, idx.view(-1, 1, 1).expand(-1, 1, picked.shape[2])).sum(dim=(1, 2))


class _BatchStats:
    """While open: notes the batch-norm layers that normalise with the batch's own statistics
    (training mode, or no running statistics) and run (a forward stopped early skips some)."""

    def __init__(self, model: nn.Module) -> None:
        self.ran: list[str] = []
        self.modules = [
            (name or "<root>", m)
            for name, m in named_modules(model)
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and (m.training or m.running_mean is None)
        ]
        self.scope: HookScope | None = None

    def _note(self, name: str) -> Callable[..., None]:
        def note(module: nn.Module, args: Any) -> None:
            if name not in self.ran:
                self.ran.append(name)

        return note

    def __enter__(self) -> _BatchStats:
        if self.modules:
            self.scope = HookScope("cam")
            self.scope.__enter__()
            for name, m in self.modules:
                self.scope.add_forward_pre(m, self._note(name), layer=name)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.scope is not None:
            self.scope.__exit__(*exc)


class CAM:
    """Base of every class-activation-map method. ``cam = Method(model, layer); cam(x, target)``.

    Subclasses set ``name`` (registry key; ``aliases`` for :func:`get_cam`), ``uses_gradients``, and override
    :meth:`channel_weights` (``(B, C)`` weights for ``sum_c w_c A_c``) or :meth:`layer_map`.

    Args:
        model: any ``nn.Module`` taking an image batch ``x`` ``(B, C, H, W)``. Its mode,
            ``requires_grad`` flags, hooks and buffers (batch-norm running statistics) are left as
            found. Put it in ``eval()`` first: a forward that draws random numbers (dropout in
            training mode) is refused with :class:`CAMError` (each call would give another map),
            and batch-norm layers computing batch statistics warn (each map would depend on the
            other samples of the batch).
        layer: a layer selector (name, glob, module, type, predicate) or a list; several layers
            give the average of their (normalised, upsampled) maps.
        reshape: how to read the activation as ``(B, C, h, w)``: ``None`` (automatic, see
            :func:`hookscope.cam._tokens.to_grid`: ViT tokens with or without a class token, Swin
            channels-last), ``(h, w)`` (the last ``h * w`` tokens) or ``fn(activation)``.
        relu: apply a ReLU to each layer's map (standard); ``False`` keeps negative evidence.
        raw: return the un-normalised maps at the layer's resolution ``(B, h, w)`` (several
            layers must then share a resolution) instead of ``(B, H, W)`` in ``[0, 1]``.

    Calling it returns a float32 tensor on ``x``'s device. See :data:`Target` for ``target``.
    A sample whose target's gradient at a layer is zero everywhere (the layer does not influence
    that score) gets an all-zero map: warned of on CPU (a :class:`HookscopeWarning` naming the
    layer and the samples), not checked on CUDA, where the test would synchronise with the host.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 3)).eval()
        >>> x = torch.randn(2, 3, 10, 10)
        >>> hs.LayerCAM(net, "0", raw=True)(x, target=lambda out: out[:, 0]).shape
        torch.Size([2, 8, 8])
        >>> hs.get_cam("eigencam")(net, "0")(x).shape
        torch.Size([2, 10, 10])
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    uses_gradients: ClassVar[bool] = True
    needs_target: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls

    def __init__(
        self,
        model: nn.Module,
        layer: Any,
        reshape: Reshape = None,
        *,
        relu: bool = True,
        raw: bool = False,
    ) -> None:
        check_model(model)
        self.model = model
        self.layers: dict[str, nn.Module] = resolve(model, layer)
        self.reshape = reshape
        self.relu = relu
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, layers={list(self.layers)})"

    # -- what a method defines --------------------------------------------------------------
    def channel_weights(self, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """``(B, C)`` weights of the channels of ``a`` ``(B, C, *spatial)`` given its gradient ``g``."""
        raise NotImplementedError(f"{type(self).__name__} must define channel_weights or layer_map")

    def layer_map(self, a: torch.Tensor, g: torch.Tensor | None, run: _Run) -> torch.Tensor:
        """The map ``(B, *spatial)`` of one layer; by default ``sum_c w_c * a_c``."""
        w = self.channel_weights(a, g)
        return (w.view(*w.shape, *([1] * (a.ndim - 2))) * a).sum(dim=1)

    # -- the template -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The maps of ``x`` for ``target`` (see :data:`Target`); the model is left as found."""
        if target is not None and not self.needs_target:
            warnings.warn(
                f"{type(self).__name__}: target={_shown(target)} is ignored: "
                f"{type(self).__name__} maps what the layer's activations hold, for no class "
                "(the same map for every target); use GradCAM (or another gradient method) "
                "for a class's map, or call it without target",
                HookscopeWarning,
                stacklevel=2,
            )
        with internal_run():  # a product's own run (see core._scope.internal_run)
            batch_stats = _BatchStats(self.model)
            with state_kept(self.model), random_draws(self.model) as draws, batch_stats:
                maps = self._maps(x, target)
            if draws.drew:
                where = draw_place(self.model, lambda: self.model(x), x)
                raise CAMError(
                    f"{type(self).__name__}: the model draws random numbers{where}, so every call "
                    f"gives another map; {draw_fix(self.model)}"
                )
            if batch_stats.ran:
                warnings.warn(
                    f"{type(self).__name__}: computed batch statistics in batch-norm layer(s) "
                    f"{some_names(batch_stats.ran)} (training mode), so each map depends on the other "
                    "samples of the batch (the running statistics were left as found); call "
                    "model.eval() first",
                    HookscopeWarning,
                    stacklevel=2,
                )
            return maps

    def _maps(self, x: torch.Tensor, target: Target) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__} expects an input tensor (B, C, H, W), got {type(x).__name__}"
            )
        if self.uses_gradients and torch.is_inference_mode_enabled():
            raise CAMError(
                f"{type(self).__name__} needs gradients, which torch.inference_mode() forbids; call it outside"
            )
        run = _Run(self, x, target)
        # the output is needed for gradients and for class targets (predicted, or range-checked);
        # a method with a target (ScoreCAM's callable ones too) runs the whole forward, so that a
        # layer called again after its first call is refused, not read at that first call (ScoreCAM
        # runs the model once per channel anyway); only EigenCAM stops at the layer
        need_output = self.uses_gradients or self.needs_target
        acts, out = self._forward(x, grad=self.uses_gradients, full=need_output)
        if need_output:
            run.resolve_target(out)
        grads: list[torch.Tensor | None] = [None] * len(acts)
        if self.uses_gradients:
            grads = self._gradients(run, out, acts)
        image_hw = tuple(x.shape[-2:]) if x.ndim >= 4 else None
        maps = []
        for (name, a), g in zip(acts.items(), grads):
            shape = tuple(a.shape)
            a = to_grid(a.detach(), self.reshape, image_hw=image_hw, layer=name).float()  # type: ignore[arg-type]
            if a.shape[0] != x.shape[0]:
                # sequence-first tokens (N, B, C) were read as N samples: N maps for B images
                raise ReshapeError(
                    f"layer {name!r} gives {shape}, read as {tuple(a.shape)} (B, C, *spatial): "
                    f"{a.shape[0]} maps for a batch of {x.shape[0]}, so its first dimension is not "
                    "the batch (sequence-first tokens (N, B, C), as nn.TransformerEncoderLayer "
                    "without batch_first?); pass reshape=fn returning (B, C, h, w), e.g. "
                    "reshape=lambda t: t[1:].permute(1, 2, 0).unflatten(2, (h, w)) for (1 + h*w, B, C)"
                )
            if g is not None:
                g = to_grid(g, self.reshape, image_hw=image_hw, layer=name).float()  # type: ignore[arg-type]
                if g.device.type == "cpu":
                    _warn_zero_gradient(type(self).__name__, name, g)
            with torch.no_grad():
                maps.append(self.layer_map(a, g, run))
        with torch.no_grad():
            return self._finish(maps, x)

    def _forward(
        self, x: torch.Tensor, *, grad: bool, full: bool
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Run the model; return ``{layer: activation}`` (grad leaves if ``grad``) and the output.

        Without ``full`` the forward pass stops once every layer has run.
        """
        if stale_names(self.model, self.layers):
            # a layer replaced since the CAM was made (model.layer4 = ...): its hooks would sit
            # on the old module, which the model no longer calls; take what each name holds now
            self.layers = resolve(self.model, list(self.layers))
        acts: dict[str, torch.Tensor] = {}
        scope = HookScope("cam")
        wanted = len(self.layers)

        def make_hook(name: str) -> Callable[..., Any]:
            def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
                if in_backward():
                    return None
                if name in acts:  # a module reused (weights shared): which call's map?
                    raise CAMError(
                        f"layer {name!r} ran more than once in one forward pass (the same module "
                        "called again, e.g. shared weights); a CAM needs one activation of the "
                        "layer: pick a layer that runs once (a wrapper around the call you "
                        "want, or that call's own submodule)"
                    )
                t = first_tensor(output)
                if t is None:
                    raise CAMError(
                        f"layer {name!r} returned no tensor ({describe(output)}); pick a layer with a tensor output"
                    )
                if not full:
                    acts[name] = t.detach()
                    if len(acts) == wanted:
                        raise scope.stop_signal()  # the forward ends here: no copy needed
                    # the rest of the forward may change this activation in place (`out += x`)
                    acts[name] = acts[name].clone()
                    return None
                # an output sharing memory with the layer's input (an in-place activation, an
                # identity, a view) is still reachable by the model through that input, which a
                # later in-place op (`h += ...`) would change under the activation we read: copy it
                alias = _aliases(t, args, kwargs)
                if grad:
                    torch.set_grad_enabled(True)  # record autograd from here on
                    if t.requires_grad:
                        src = t.clone() if alias else t
                    else:
                        src = (t.detach().clone() if alias else t.detach()).requires_grad_()
                else:
                    src = t.detach().clone() if alias else t.detach()
                acts[name] = src
                # pass on a copy: later in-place ops change the copy, not the activation we read
                return replace_first(output, src.clone())

            return hook

        prev = torch.is_grad_enabled()
        out = None
        try:
            with scope:
                for name, module in self.layers.items():
                    scope.add_forward(module, make_hook(name), layer=name, with_kwargs=True)
                torch.set_grad_enabled(False)
                out = self.model(x)
        finally:
            torch.set_grad_enabled(prev)
        missing = [n for n in self.layers if n not in acts]
        if missing:
            raise CAMError(
                f"layer(s) {', '.join(map(repr, missing))} never ran during the forward pass (PyTorch runs hooks "
                "only through module(...); a parent calling child.forward() directly, or a branch not taken, skips them)"
            )
        return acts, out

    def _gradients(
        self, run: _Run, out: Any, acts: dict[str, torch.Tensor]
    ) -> list[torch.Tensor | None]:
        with torch.enable_grad():
            score = run.score(out).sum()
        if not score.requires_grad:
            raise CAMError(
                f"the target score does not depend on layer(s) {', '.join(map(repr, acts))} through autograd "
                "(is the layer on the path to the output? does the model run the later part under no_grad?)"
            )
        srcs = list(acts.values())
        grads = torch.autograd.grad(score, srcs, allow_unused=True)
        for name, g in zip(acts, grads):
            if g is None:
                raise CAMError(
                    f"the target score does not depend on layer {name!r}: no gradient reaches it"
                )
        return list(grads)

    def _finish(self, maps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.relu:
            maps = [m.clamp_min(0) for m in maps]
        if self.raw:
            shapes = {tuple(m.shape) for m in maps}
            if len(shapes) > 1:
                raise CAMError(
                    f"raw=True with several layers needs equal map sizes; got {sorted(shapes)}"
                )
            return maps[0] if len(maps) == 1 else torch.stack(maps).mean(dim=0)
        spatial = maps[0].ndim - 1
        if x.ndim - 2 != spatial:
            raise CAMError(
                f"cannot upsample a {spatial}-D map to an input of shape {tuple(x.shape)}; use raw=True for layer-resolution maps"
            )
        size = tuple(x.shape[2:])
        ups = []
        for m in maps:
            m = _minmax(m)
            if tuple(m.shape[1:]) != size:
                m = F.interpolate(
                    m.unsqueeze(1), size=size, mode=_MODES[spatial], align_corners=False
                ).squeeze(1)
            ups.append(m)
        cam = ups[0] if len(ups) == 1 else torch.stack(ups).clamp_min(0).mean(dim=0)
        return _minmax(cam)


def _warn_zero_gradient(cam: str, name: str, g: torch.Tensor) -> None:
    """Warn when the gradient ``g`` ``(B, C, *spatial)`` of layer ``name`` is zero everywhere for a
    sample: its map is then all zeros, which read as "no evidence here" without a word. Called on
    CPU only: on CUDA the test would synchronise with the host, which the CAM contract forbids."""
    zero = (g.reshape(g.shape[0], -1) == 0).all(dim=1).nonzero().flatten().tolist()
    if zero:
        shown = ", ".join(map(str, zero[:8])) + (" ..." if len(zero) > 8 else "")
        warnings.warn(
            f"{cam}: the gradient of the target score at layer {name!r} is zero everywhere for "
            f"sample(s) {shown} (of {g.shape[0]}): what the map reads of the layer does not "
            "influence that target's score (a layer off the path to it, or a ViT's last block, "
            "whose patch tokens do not reach the class token the head reads), so the map is all "
            "zeros, not where the evidence is; pick a layer on the path to that score (an "
            "earlier block for a ViT) or another target",
            HookscopeWarning,
            stacklevel=4,  # _warn_zero_gradient <- _maps <- __call__ <- the caller
        )


def _shown(target: Any) -> str:
    """A target as a warning shows it (a tensor by its shape)."""
    if isinstance(target, torch.Tensor):
        return f"tensor of shape {tuple(target.shape)}" if target.dim() else str(target.item())
    text = repr(target)
    return text if len(text) <= 40 else text[:37] + "..."
