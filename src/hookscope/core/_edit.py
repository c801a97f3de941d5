"""``edit``, ``edit_grads``, ``clip_grads``: change activations, inputs and gradients in a scope."""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn as nn

from . import _ops as ops
from ._compiled import named_modules, named_parameters
from ._errors import HookscopeError, LayerNotFoundError
from ._gradcheck import FireCheck
from ._nested import iter_tensors
from ._scope import HookScope, check_model
from ._select import find, suggest
from ._sharded import add_param_grad_editor, check_tensor_type

__all__ = ["clip_grads", "edit", "edit_grads", "positional_index"]

Edit = Callable[[Any], Any] | torch.Tensor | ops.Op


def positional_index(module: nn.Module, arg: str) -> int | None:
    """The positional index of ``module.forward``'s parameter ``arg`` (None: keyword-only/unknown)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == arg and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def edit(
    model: nn.Module,
    edits: Mapping[Any, Edit],
    *,
    at: Literal["output", "input"] = "output",
    arg: int | str | None = None,
) -> HookScope:
    """Replace or change layer outputs (or inputs) while the returned scope is active.

    Args:
        model: any ``nn.Module``.
        edits: ``{layer selector: edit}``. Each edit is a :mod:`hookscope.ops` op (applied to
            every tensor of the value), a tensor (the replacement) or a function
            ``fn(value) -> new_value | None`` (``None`` keeps the value).
        at: ``"output"`` (the default) edits what the layer returns; ``"input"`` what it
            receives: its first positional input, or ``arg``.
        arg: with ``at="input"``, which input: a positional index or a parameter name of the
            layer's ``forward`` (passed by keyword or by position).

    Returns the scope: the edits act until it is removed (or its ``with`` block ends).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with hs.edit(net, {"0": hs.ops.zero()}):
        ...     net(torch.ones(1, 2)).tolist()
        [[0.0, 0.0]]
    """
    check_model(model)
    if at not in ("output", "input"):
        raise ValueError(f"at must be 'output' or 'input', got {at!r}")
    if arg is not None and at != "input":
        raise ValueError("arg= selects an input; use it with at='input'")
    plan: list[tuple[str, nn.Module, Edit]] = []
    for sel, fn in edits.items():
        for name, module in find(model, sel).items():
            plan.append((name, module, fn))
    scope = HookScope("edit")
    try:
        for name, module, fn in plan:
            if at == "output":
                scope.add_forward(module, _output_editor(name, fn), layer=name)
            else:
                scope.add_forward_pre(
                    module, _input_editor(name, module, fn, arg), layer=name, with_kwargs=True
                )
    except BaseException:
        scope.remove()
        raise
    return scope


def _output_editor(name: str, fn: Edit) -> Callable[..., Any]:
    what = f"the output of {name!r}"

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return ops.apply(fn, output, what)

    return hook


def _input_editor(
    name: str, module: nn.Module, fn: Edit, arg: int | str | None
) -> Callable[..., Any]:
    position = positional_index(module, arg) if isinstance(arg, str) else arg

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(arg, str) and arg in kwargs:
            kwargs = dict(kwargs)
            kwargs[arg] = ops.apply(fn, kwargs[arg], f"input {arg!r} of {name!r}")
            return args, kwargs
        i = 0 if arg is None else position
        if i is None or i >= len(args):
            given = [f"{len(args)} positional"] + [repr(k) for k in kwargs]
            wanted = "a positional input" if arg is None else f"input {arg!r}"
            raise HookscopeError(
                f"edit(at='input') on {name!r}: the call has no {wanted}; it got {', '.join(given)}. "
                "Pass arg= with a positional index or a keyword name"
            )
        args = list(args)
        args[i] = ops.apply(fn, args[i], f"input {i} of {name!r}")
        return tuple(args), kwargs

    return hook


def _grad_editor(fn: Edit, what: str) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def on_grad(grad: torch.Tensor) -> torch.Tensor | None:
        return ops.apply(fn, grad, what)

    return on_grad


def _resolve_grad_targets(
    model: nn.Module | None, key: Any
) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """A key of edit_grads: module selector(s), parameter name/glob, or a tensor."""
    if isinstance(key, torch.Tensor):
        return {}, {f"<tensor {tuple(key.shape)}>": key}
    if model is None:
        raise ValueError(
            "edit_grads(None, ...) accepts only tensors as keys; pass the model to name layers"
        )
    params = dict(named_parameters(model))
    if isinstance(key, str):
        if key in params:
            return {}, {key: params[key]}
        if set("*?[") & set(key):
            hit = {k: p for k, p in params.items() if fnmatch.fnmatchcase(k, key)}
            try:
                mods = find(model, key)
            except LayerNotFoundError:
                mods = {}
            if hit or mods:
                return mods, hit
        else:
            names = [n for n, _ in named_modules(model)]
            if key not in names:
                close = suggest(key, [*names, *params])
                raise LayerNotFoundError(
                    f"no layer or parameter named {key!r} in {type(model).__name__}; closest: "
                    + ", ".join(repr(c) for c in close)
                )
    return find(model, key), {}


def edit_grads(model: nn.Module | None, edits: Mapping[Any, Edit]) -> HookScope:
    """Change gradients while the returned scope is active.

    Args:
        model: the model whose layers and parameters the keys name; ``None`` when every key is
            a tensor.
        edits: ``{what: edit}``. A key is a layer selector (the gradient w.r.t. the layer's
            output, before it flows back into the layer), a parameter name or glob
            (``"fc.bias"``, ``"*.bias"``: the gradient before it is accumulated into ``.grad``),
            or a tensor (e.g. a leaf input). An edit is an op, a tensor or
            ``fn(grad) -> new_grad | None``.

    Works with in-place layers (``ReLU(inplace=True)``): gradients are edited through tensor
    hooks, never through module backward hooks. Distributed, a parameter edit acts on the
    gradient one process on the combined batch would have: under ``DistributedDataParallel`` on
    the averaged gradient (after DDP's all-reduce; once per step under ``no_sync()``
    accumulation), under FSDP2 on the reduced gradient, under tensor parallelism on the full one.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Linear(2, 1)
        >>> with hs.edit_grads(net, {"bias": hs.ops.zero()}):
        ...     net(torch.ones(3, 2)).sum().backward()
        >>> net.bias.grad.tolist()
        [0.0]
    """
    if model is not None:
        check_model(model)
    scope = HookScope("edit_grads")
    check: FireCheck | None = None
    try:
        for key, fn in edits.items():
            modules, tensors = _resolve_grad_targets(model, key)
            for name, module in modules.items():
                scope.add_forward(module, _output_grad_editor(scope, name, fn), layer=name)
            for name, t in tensors.items():
                if not t.requires_grad:
                    raise HookscopeError(
                        f"edit_grads: {name} does not require grad, so it never gets a gradient"
                    )
                if check is None and model is not None:
                    check = FireCheck(scope, model, "edit_grads")
                add_param_grad_editor(
                    scope, model, name, t, _grad_editor(fn, f"the gradient of {name}"), check
                )
    except BaseException:
        scope.remove()
        raise
    return scope


def _output_grad_editor(scope: HookScope, name: str, fn: Edit) -> Callable[..., None]:
    what = f"the gradient of {name!r}'s output"
    on_grad = _grad_editor(fn, what)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for _, t in iter_tensors(output):
            check_tensor_type(t, f"the output of layer {name!r}")
            if t.requires_grad:
                scope.add_activation_grad_hook(t, on_grad, layer=name)

    return hook


def clip_grads(
    model: nn.Module,
    value: float | None = None,
    max_norm: float | None = None,
    *,
    params: Any = None,
) -> HookScope:
    """Clip every parameter's gradient by hooks, as it is computed; stays until removed.

    Args:
        model: the model whose parameters' gradients are clipped.
        value: clamp each element into ``[-value, value]``.
        max_norm: rescale each parameter's gradient to an L2 norm of at most ``max_norm`` (per
            parameter, unlike ``torch.nn.utils.clip_grad_norm_``, which uses the global norm).
        params: parameter names or globs to clip (default: every parameter).

    Returns the scope: ``.remove()`` it (or use ``with``) to stop.
    Distributed (DDP, FSDP2, tensor parallel), it clips the averaged, full gradient, as one
    process on the combined batch would (see :func:`edit_grads`).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Linear(2, 1)
        >>> handle = hs.clip_grads(net, value=0.01)
        >>> net(torch.full((4, 2), 10.0)).sum().backward()
        >>> round(float(net.weight.grad.abs().max()), 6)
        0.01
        >>> handle.remove()
    """
    if value is None and max_norm is None:
        raise ValueError("clip_grads needs value=, max_norm= or both")
    if value is not None and value <= 0:
        raise ValueError(f"clip_grads: value must be > 0, got {value}")
    check_model(model)
    chain: list[ops.Op] = []
    if value is not None:
        chain.append(ops.clamp(-value, value))
    if max_norm is not None:
        chain.append(ops.clip_norm(max_norm))

    def clip(grad: torch.Tensor) -> torch.Tensor:
        for op in chain:
            grad = op(grad)
        return grad

    named = dict(named_parameters(model))
    if params is not None:
        pats = [params] if isinstance(params, str) else list(params)
        chosen = {
            k: p for k, p in named.items() if any(fnmatch.fnmatchcase(k, pat) for pat in pats)
        }
        if not chosen:
            raise LayerNotFoundError(
                f"clip_grads: params {pats!r} matched no parameter; closest: {suggest(pats[0], named)}"
            )
        named = chosen
    scope = HookScope("clip_grads")
    try:
        check = FireCheck(scope, model, "clip_grads")
        for name, p in named.items():
            if p.requires_grad:
                add_param_grad_editor(scope, model, name, p, clip, check)
    except BaseException:
        scope.remove()
        raise
    return scope
