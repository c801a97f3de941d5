"""``edit``, ``edit_grads``, ``clip_grads``: change activations, inputs and gradients in a scope."""

from __future__ import annotations

import fnmatch
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn as nn

from . import _ops as ops
from ._compiled import named_modules, named_parameters
from ._errors import HookscopeError, HookscopeWarning, LayerNotFoundError, some_names
from ._gradcheck import FireCheck
from ._nested import iter_tensors
from ._recompute import Replays
from ._scope import HookScope, check_model, ran_in_copy, warn_lost
from ._select import find, resolve, suggest
from ._sharded import add_param_grad_editor, check_tensor_type, is_dtensor, warn_tp_shards

__all__ = ["clip_grads", "edit", "edit_grads", "positional_index"]

Edit = Callable[[Any], Any] | torch.Tensor | ops.Op


def positive_number(v: Any, what: str) -> float:
    """``v`` as a float, refusing a non-number, NaN, infinity, zero or a negative number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a number > 0; got {type(v).__name__}: {v!r}")
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} must be a finite number > 0; got {v}")
    return float(v)


NEVER_RAN = (
    "it was never called through module(...) while the scope was open (a parent that calls "
    "child.forward(...) directly skips hooks, a branch not taken does not run, and a compiled "
    "graph hookscope was not given ignores them: give hookscope the object you call); a scope "
    "acts only on the calls of the thread that created it"
)


class _Reached:
    """Counts the calls an edit acted on, per layer; when its scope closes without an exception,
    warns (:class:`HookscopeWarning`) naming the layers it never acted on, and first the layers
    and parameters whose hooks stopped acting while it was open (:meth:`track`): the model holds
    another module or parameter at that name now, or ``hs.remove_hooks`` took them."""

    __slots__ = ("counts", "lost", "names", "owner", "scope", "what")

    def __init__(self, scope: HookScope, owner: str, what: str) -> None:
        self.scope, self.owner, self.what = scope, owner, what
        self.counts: dict[str, int] = {}
        self.names: set[str] = set()  # the tracked layers and parameters
        self.lost: set[str] = set()  # those whose hooks stopped acting (set at removal)
        scope.on_remove(self._check_lost)  # (first: the other checks leave these names out)
        scope.on_remove(self._check)

    def track(
        self,
        model: nn.Module | None,
        modules: Mapping[str, nn.Module] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Watch where the hooks of these layers and parameters sit (:meth:`HookScope.track`)."""
        if model is None:
            return
        self.scope.track(model, modules, params)
        self.names.update(modules or ())
        self.names.update(params or ())

    def _check_lost(self) -> None:
        verb = "clipped" if self.owner == "clip_grads" else "edited"
        self.lost = warn_lost(self.scope, self.names, self.owner, verb, self.counts)

    def watch(self, name: str) -> dict[str, int]:
        """The counts; the hook of ``name`` adds 1 to ``counts[name]`` for each call it acts on."""
        self.counts.setdefault(name, 0)
        return self.counts

    def grads(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per layer (layer keys of edit_grads): the outputs given a gradient hook and the
        gradients that reached it. At exit, a layer whose output got a hook in the scope but no
        gradient while it was open warns."""
        hooked: dict[str, int] = {}
        got: dict[str, int] = {}
        self.scope.on_remove(lambda: self._check_grads(hooked, got))
        return hooked, got

    def _check_grads(self, hooked: dict[str, int], got: dict[str, int]) -> None:
        if self.scope.failed or sys.exc_info()[1] is not None:
            return
        never = [n for n, c in hooked.items() if c and not got.get(n) and n not in self.lost]
        if never:
            warnings.warn(
                f"{self.owner}: the output of layer(s) {some_names(never)} got no gradient while "
                "the scope was open, so nothing was edited there: call backward() inside the "
                "with block (or before .remove()); the graph built in the scope keeps no edit "
                "once it is closed",
                HookscopeWarning,
                stacklevel=4,
            )

    def none_fired(self, check: FireCheck, owner: str) -> None:
        """Warn at exit when no watched parameter got a gradient while the scope was open."""
        self.scope.on_remove(lambda: self._check_none(check, owner))

    def _check_none(self, check: FireCheck, owner: str) -> None:
        if self.scope.failed or sys.exc_info()[1] is not None:
            return
        if self.lost:  # (its hooks were replaced or removed: said at once)
            return
        if not any(check.count.values()) and not check.reported:  # (reported: already loud)
            which = (
                "no parameter of the model requires grad"
                if not check.count
                else "no parameter got a gradient while the scope was open"
            )
            warnings.warn(
                f"{owner}: {which}, so nothing was clipped: call backward() inside the with "
                "block (or before .remove()) on a loss of a forward that requires grad",
                HookscopeWarning,
                stacklevel=4,
            )

    def params(self, check: FireCheck, names: list[str]) -> None:
        """Also warn for the parameters ``names`` whose gradient hook never ran (``check``)."""
        self.scope.on_remove(lambda: self._check_params(check, names))

    def _check_params(self, check: FireCheck, names: list[str]) -> None:
        if self.scope.failed or sys.exc_info()[1] is not None:
            return
        never = [
            n
            for n in names
            if not check.count.get(n) and n not in check.reported and n not in self.lost
        ]
        if never:
            warnings.warn(
                f"{self.owner}: parameter(s) {some_names(never)} got no gradient while the scope "
                "was open, so nothing was edited there: the layer holding them never ran in a "
                "forward whose loss was back-propagated (or ran under no_grad)",
                HookscopeWarning,
                stacklevel=4,
            )

    def _check(self) -> None:
        if self.scope.failed or sys.exc_info()[1] is not None:
            return  # an exception is on its way: it says more than a warning
        never = [n for n, c in self.counts.items() if not c and n not in self.lost]
        copied = [n for n in never if ran_in_copy(self.scope, n)]
        if copied:  # (a deep copy of the model ran them: the copy's hooks are inert)
            never = [n for n in never if n not in copied]
            warnings.warn(
                f"{self.owner}: layer(s) {some_names(copied)} ran only in a deep copy of the "
                "model (copy.deepcopy, made while the scope was open), whose hooks are inert, "
                f"so nothing was edited there: open the {self.owner} on the copy, or call the "
                "model the scope was opened on",
                HookscopeWarning,
                stacklevel=4,
            )
        if never:
            warnings.warn(
                f"{self.owner}: layer(s) {some_names(never)} {self.what}, so nothing was edited "
                f"there: {NEVER_RAN}",
                HookscopeWarning,
                stacklevel=4,
            )


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
    if arg is not None and (
        isinstance(arg, bool)
        or not isinstance(arg, (int, str))
        or (isinstance(arg, int) and arg < 0)
    ):
        raise TypeError(
            f"edit: arg= must be a positional index (an int >= 0) or a parameter name (a str), "
            f"got {arg!r}"
        )
    _check_edits(edits, "edit")
    plan: list[tuple[str, nn.Module, Edit]] = []
    for sel, fn in edits.items():
        _check_edit(fn, f"edit: the edit for {sel!r}")
        for name, module in resolve(model, sel, "a key of edits").items():
            plan.append((name, module, fn))
    scope = HookScope("edit")
    try:
        reached = _Reached(scope, "edit", "never ran while the scope was open")
        reached.track(model, {name: module for name, module, _ in plan})
        replays = Replays(scope, "edit")  # exact under activation checkpointing
        for name, module, fn in plan:
            ran = reached.watch(name)
            if at == "output":
                scope.add_forward(module, _output_editor(name, fn, ran, replays), layer=name)
            else:
                scope.add_forward_pre(
                    module,
                    _input_editor(name, module, fn, arg, (ran, replays)),
                    layer=name,
                    with_kwargs=True,
                )
        if at == "output":  # tensor parallel: an edit that reads the whole output sees a shard
            whole = {name: module for name, module, fn in plan if not _elementwise(fn)}
            if whole:
                warn_tp_shards(scope, model, whole, _SHARD_EDIT)
    except BaseException:
        scope.remove()
        raise
    return scope


_SHARD_EDIT = (
    "the edit of {name!r} acts on this rank's part (shape {shape}) alone: a norm, a channel "
    "index or a function of the whole output would see a part"
)


_SHARD_GRAD_EDIT = (
    "the edit of the gradient of {name!r} acts on this rank's part (shape {shape}) alone: a "
    "norm, a channel index or a function of the whole gradient would see a part"
)


def _elementwise(fn: Any) -> bool:
    """Is ``fn`` an op that acts on each element alone, the same on a shard as on the whole
    (zero, clamp, and scale/add by one number)?"""
    if isinstance(fn, (ops._Zero, ops._Clamp)):
        return True
    if isinstance(fn, (ops._Scale, ops._Add)):
        v = fn.k if isinstance(fn, ops._Scale) else getattr(fn, "v", None)
        return not isinstance(v, torch.Tensor) or v.numel() == 1
    return False


def _check_edits(edits: Any, owner: str) -> None:
    if not isinstance(edits, Mapping):
        raise TypeError(
            f"{owner}: edits must be a dict {{layer selector: edit}}; got {type(edits).__name__}"
        )
    if not edits:
        raise LayerNotFoundError(
            f"{owner}: edits is empty, so nothing would be edited; give {{layer: edit}} pairs, "
            "e.g. {'fc1': hs.ops.zero()}"
        )


def _check_edit(fn: Any, what: str) -> None:
    """Refuse, when the scope is made, an edit that could only fail (or do nothing) at run time."""
    if not isinstance(fn, (torch.Tensor, ops.Op)) and not callable(fn):
        raise TypeError(
            f"{what} must be a hs.ops op, a tensor or a callable fn(value) -> new value | None; "
            f"got {type(fn).__name__}: {fn!r}"
        )


def _output_editor(
    name: str, fn: Edit, ran: dict[str, int], replays: Replays
) -> Callable[..., Any]:
    what = f"the output of {name!r}"

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if not replays.acts(name):
            return None  # a recompute of a call this scope did not edit
        ran[name] += 1
        new = ops.apply(fn, output, what)
        replays.acted_on(name, module, new)
        return new

    return hook


def _input_editor(
    name: str,
    module: nn.Module,
    fn: Edit,
    arg: int | str | None,
    state: tuple[dict[str, int], Replays],
) -> Callable[..., Any]:
    position = positional_index(module, arg) if isinstance(arg, str) else arg
    ran, replays = state

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not replays.acts(name):
            return None  # a recompute of a call this scope did not edit
        ran[name] += 1
        if isinstance(arg, str) and arg in kwargs:
            kwargs = dict(kwargs)
            kwargs[arg] = ops.apply(fn, kwargs[arg], f"input {arg!r} of {name!r}")
            replays.acted_on(name, module, kwargs[arg])
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
        replays.acted_on(name, module, args[i])
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
    _check_edits(edits, "edit_grads")
    for key, fn in edits.items():
        _check_edit(fn, f"edit_grads: the edit for {key!r}")
    scope = HookScope("edit_grads")
    check: FireCheck | None = None
    try:
        reached = _Reached(
            scope,
            "edit_grads",
            "never ran while the scope was open with an output that requires grad",
        )
        named_params: list[str] = []  # parameters named by a key (FireCheck counts their hooks)
        hooked, got = reached.grads()
        whole: dict[str, nn.Module] = {}  # layers whose edit reads the whole output gradient
        for key, fn in edits.items():
            modules, tensors = _resolve_grad_targets(model, key)
            for name, module in modules.items():
                ran = reached.watch(name)
                editor = _output_grad_editor(scope, name, fn, (ran, hooked, got))
                scope.add_forward(module, editor, layer=name)
                reached.track(model, {name: module})
                if not _elementwise(fn):
                    whole[name] = module
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
                named_params.append(name)
                if not isinstance(key, torch.Tensor):  # (a tensor key is the user's own tensor)
                    reached.track(model, params={name: t})
        if check is not None:
            reached.params(check, named_params)
        if whole and model is not None:  # tensor parallel: a shard's gradient is a shard
            warn_tp_shards(scope, model, whole, _SHARD_GRAD_EDIT)
    except BaseException:
        scope.remove()
        raise
    return scope


def _output_grad_editor(
    scope: HookScope,
    name: str,
    fn: Edit,
    counts: tuple[dict[str, int], dict[str, int], dict[str, int]],
) -> Callable[..., None]:
    what = f"the gradient of {name!r}'s output"
    edit_grad = _grad_editor(fn, what)
    ran, hooked, got = counts

    def on_grad(grad: torch.Tensor) -> torch.Tensor | None:
        got[name] = got.get(name, 0) + 1
        return edit_grad(grad)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for _, t in iter_tensors(output):
            if t.requires_grad:
                ran[name] += 1  # (before the type check: a refused tensor is reported there)
            check_tensor_type(t, f"the output of layer {name!r}")
            if t.requires_grad:
                scope.add_activation_grad_hook(t, on_grad, layer=name)
                hooked[name] = hooked.get(name, 0) + 1

    return hook


def _accumulation_check(
    scope: HookScope,
    name: str,
    param: torch.Tensor,
    clip: Callable[[torch.Tensor], torch.Tensor],
    said: list[bool],
    what: str,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``clip``, warning once per scope when this backward's gradient will be added to a
    ``.grad`` that the previous backward left untouched (gradient accumulation, or no
    ``zero_grad``): each backward's gradient is clipped, not their sum. A ``.grad`` zeroed in
    place (``zero_grad(set_to_none=False)``) has a new version, so it is not mistaken for one."""
    after: list[tuple[int, int] | None] = [None]  # .grad (storage, version) after accumulating

    def note(p: torch.Tensor) -> None:
        g = p.grad
        after[0] = (g.data_ptr(), g._version) if g is not None else None

    scope.add_post_accumulate_grad(param, note, layer=name)

    def on_grad(grad: torch.Tensor) -> torch.Tensor:
        g = param.grad
        if (
            not said[0]
            and g is not None
            and g.data_ptr() != grad.data_ptr()  # (DDP: the edit is of .grad itself)
            and after[0] == (g.data_ptr(), g._version)
        ):
            said[0] = True
            warnings.warn(
                f"clip_grads: {name!r} gets a second backward's gradient before its .grad was "
                "zeroed (gradient accumulation, or no zero_grad between steps): clip_grads clips "
                f"each backward's gradient, so the accumulated .grad is the sum of clipped "
                f"gradients and can exceed {what}. To clip the accumulated gradient, call "
                "torch.nn.utils.clip_grad_norm_ (one global norm) or clip_grad_value_ on the "
                "parameters before optimizer.step(), instead of clip_grads",
                HookscopeWarning,
                stacklevel=2,
            )
        return clip(grad)

    return on_grad


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

    Each backward pass's gradient is clipped before it is added to ``.grad``: with gradient
    accumulation (several backward passes per optimizer step) ``.grad`` is the sum of clipped
    gradients, which can exceed the limit, and a warning says so (under DDP and FSDP2 the
    accumulated gradient is clipped once, at the step's synchronising backward).

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
    for arg, v in (("value", value), ("max_norm", max_norm)):
        if v is not None:
            positive_number(v, f"clip_grads: {arg}")
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
        if not pats or not all(isinstance(x, str) for x in pats):
            raise TypeError(
                f"clip_grads: params must be a parameter name or glob, or a non-empty list of "
                f"them (e.g. '*.weight'); got {params!r}"
            )
        chosen = {
            k: p for k, p in named.items() if any(fnmatch.fnmatchcase(k, pat) for pat in pats)
        }
        if not chosen:
            raise LayerNotFoundError(
                f"clip_grads: params {pats!r} matched no parameter; closest: {suggest(pats[0], named)}"
            )
        named = chosen
    scope = HookScope("clip_grads")
    what = "max_norm" if value is None else "value" if max_norm is None else "value/max_norm"
    try:
        check = FireCheck(scope, model, "clip_grads")
        said = [False]
        for name, p in named.items():
            if p.requires_grad:
                on_grad = clip
                if not is_dtensor(p):  # (FSDP2 edits the accumulated, reduced .grad itself)
                    on_grad = _accumulation_check(scope, name, p, clip, said, what)
                add_param_grad_editor(scope, model, name, p, on_grad, check)
        reached = _Reached(scope, "clip_grads", "")
        reached.track(model, params={n: p for n, p in named.items() if p.requires_grad})
        if params is not None:  # named: each should get a gradient (all of them: some may not)
            reached.params(check, [n for n, p in named.items() if p.requires_grad])
        else:  # the whole model: at least one parameter should get a gradient
            reached.none_fired(check, "clip_grads")
    except BaseException:
        scope.remove()
        raise
    return scope
