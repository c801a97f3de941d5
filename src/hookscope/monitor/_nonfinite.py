"""Where did the NaN come from? Locate the first layer that produced a NaN or Inf.

Forward: the first call (in completion order) whose output is worse than its inputs, where NaN is
worse than Inf, which is worse than finite. Every module is hooked, parents included, so a NaN
made by a functional op inside a parent's ``forward`` is blamed on that parent, and a module that
only passes a NaN on is never blamed. Backward: the first call (in the order autograd reaches its
inputs) whose input-gradient is worse than its output-gradient; input gradients come from identity
views put in front of each call's inputs (the design of ``capture(inputs=True, grads=True)``).

Each check is one device reduction, ``max |x|`` (NaN propagates through ``max``, so one number
tells finite / Inf / NaN), and the host reads all of them once, at the end. An allow-list names
layers that may produce infinities on purpose (``-inf`` attention masks); a NaN is still reported.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from ..core._buffers import state_kept
from ..core._compiled import named_modules, named_parameters
from ..core._errors import HookscopeWarning, some_names
from ..core._nested import continuous, first_tensor, iter_tensors, map_tensors, real_parts
from ..core._recompute import in_reentrant_checkpoint
from ..core._scope import (
    HookScope,
    ancestors,
    attribute_path,
    check_model,
    identity_views,
    in_backward,
    internal_run,
    lost_layers,
)
from ..core._select import find
from ..core._sharded import is_dtensor, local
from ._stats import minmax

__all__ = ["INPUT", "LOSS", "NonFiniteOrigin", "find_nonfinite"]

INPUT = "<input>"
"""Layer name reported when the non-finite value entered with the model's input."""
LOSS = "<loss>"
"""Layer name reported when the loss (or the gradient given to backward) was not finite."""

_INF = float("inf")


@dataclass(frozen=True)
class NonFiniteOrigin:
    """Where a NaN/Inf was first produced.

    Attributes:
        layer: dotted layer path (``""`` is the model itself), ``NonFiniteOrigin.INPUT``
            (``"<input>"``) or ``NonFiniteOrigin.LOSS`` (``"<loss>"``).
        phase: ``"forward"`` or ``"backward"``.
        call: the layer's call index in that pass (0 for its first call).
        kind: ``"nan"`` or ``"inf"``.
        module_type: class name of the layer (``""`` for the input or the loss).
        stats: the offending numbers, e.g. ``{"input_absmax": 2.0, "output_absmax": nan}``.
        argument: for the input, the model's argument that held it (a parameter or keyword
            name, with the path inside it: ``"batch['x']"``); ``""`` otherwise.
    """

    INPUT: ClassVar[str] = "<input>"
    LOSS: ClassVar[str] = "<loss>"

    layer: str
    phase: str
    call: int
    kind: str
    module_type: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    argument: str = ""

    def __str__(self) -> str:
        where = (
            self.layer
            if self.layer in (INPUT, LOSS)
            else f"layer {self.layer or '<root>'!r} ({self.module_type}) call {self.call}"
        )
        if self.argument:
            where += f" argument {self.argument!r}"
        nums = ", ".join(f"{k}={v:.4g}" for k, v in self.stats.items())
        return f"{self.kind.upper()} first produced in the {self.phase} pass by {where}: {nums}"


def _absmax(obj: Any) -> torch.Tensor | None:
    """``[min, max, min, max, ...]`` of every floating tensor in ``obj`` (fp32, on the device), or
    None; the host turns it into ``max |x|`` (NaN if any NaN). ``aminmax`` is one pass and among
    the fastest reductions on CPU (``vector_norm(x, inf)`` is ~20x slower there)."""
    # a DTensor (tensor parallel) is checked on this rank's shard: the rank holding a NaN sees it
    vals = [
        minmax(real_parts(local(t) if is_dtensor(t) else t))
        for _, t in iter_tensors(obj)
        if continuous(t) and t.numel() > 0
    ]
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else torch.cat(vals)


def _argument(module: nn.Module, path: tuple[Any, ...]) -> str:
    """The name of the argument at ``path`` in ``(args, kwargs)`` of ``module``'s call:
    a keyword's name, a positional one's parameter name (else ``"argument <i>"``), with the
    path inside it (``"batch[0]"``)."""
    if len(path) < 2:
        return ""
    where, key, rest = path[0], path[1], path[2:]
    if where == 1:
        name = str(key)
    else:
        try:
            ps = [
                p
                for p in inspect.signature(module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            name = ps[key].name if isinstance(key, int) and key < len(ps) else f"argument {key}"
        except (TypeError, ValueError):
            name = f"argument {key}"
    return name + "".join(f"[{k!r}]" for k in rest)


def _absmax_host(v: list[float]) -> float:
    if any(math.isnan(x) for x in v):
        return math.nan
    return max((abs(x) for x in v), default=0.0)


def _counts(obj: Any) -> torch.Tensor:
    """``[nan count, inf count]`` over every floating tensor in ``obj`` (fp32)."""
    out = torch.zeros(2)
    for _, t in iter_tensors(obj):
        if continuous(t):
            t = t.detach()  # (a complex value counts once: NaN or inf in either part)
            out = out.to(t.device) + torch.stack([t.isnan().sum(), t.isinf().sum()]).float()
    return out


def _state(v: float) -> int:
    return 2 if math.isnan(v) else (1 if math.isinf(v) else 0)


_KIND = {1: "inf", 2: "nan"}

# Modules whose backward maps finite gradients (and finite weights) to finite gradients, barring
# fp32 overflow: linear maps, normalisations (eps > 0), piecewise-linear activations, pooling.
_BACKWARD_SAFE: tuple[type, ...] = (
    nn.Linear,
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.dropout._DropoutNd,
    nn.Identity,
    nn.Flatten,
    nn.Embedding,
)


class _Tracker:
    """Hooks every module of a model (its own scope) and records ``max |x|`` per call."""

    def __init__(
        self,
        model: nn.Module,
        allow: Iterable[Any] = (),
        *,
        detail: bool = False,
        skip_safe: bool = False,
        owner: str = "nonfinite",
        gate: list[bool] | None = None,
        skip_evaluations: bool = False,
    ) -> None:
        allow = list(allow) if not isinstance(allow, (str, type)) else [allow]
        self.allow_input = INPUT in allow
        sel = [a for a in allow if a != INPUT]
        self.allowed: set[str] = set(find(model, *sel)) if sel else set()
        self.detail, self.skip_safe = detail, skip_safe
        # the monitor's: calls while it is paused, and calls of the model under no_grad /
        # inference_mode (evaluations), are left out, as its records leave them out
        self.gate = gate if gate is not None else [True]
        self.skip_evaluations = skip_evaluations
        self.evaluating = False
        named = dict(named_modules(model))
        self.types = {name: type(m).__name__ for name, m in named.items()}
        self.scope = HookScope(owner)
        self.warned_reentrant = False
        self.reset()
        try:
            for name, module in named.items():
                self._register(name, module)
        except BaseException:
            self.scope.remove()
            raise
        # where the hooks sit (weakly): a module replaced in (or added to) the model later runs
        # unhooked, its NaN blamed on its caller; asked by lost(), never in the hooks
        self.scope.track(model, named)

    def lost(self, added: bool = False) -> dict[str, str]:
        """The modules whose calls this tracker no longer sees (core's :func:`lost_layers`: a
        module replaced or removed, hooks ``hs.remove_hooks`` took, and with ``added`` a module
        put in the model since: a walk of the model, asked only when an origin was found). Not
        from the hooks."""
        return lost_layers(self.scope, self.types if added else None)

    def reset(self) -> None:
        self.evaluating = False
        self.counts: dict[str, int] = {}
        self.input: torch.Tensor | None = None
        self.input_names: list[tuple[Any, int]] = []  # (path, values) of each input tensor
        self.root: weakref.ref[nn.Module] | None = None
        self.fwd: list[tuple[str, int, torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = []
        self.bwd: list[tuple[str, int, list[list[Any]], torch.Tensor, torch.Tensor | None]] = []
        self.root_gout: list[list[Any]] = []
        # keyed by id(); the weak reference tells a live tensor from a new one at a reused id,
        # without keeping activations alive past their use
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor | None]] = {}
        self._cells: dict[int, tuple[weakref.ref[torch.Tensor], list[Any]]] = {}

    def _known(self, t: torch.Tensor) -> torch.Tensor | None:
        """The value already reduced for this very tensor, unchanged since (a layer's output
        seen again as the next layer's input, or as its parent's output), else None."""
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        return None

    def _remember(self, t: torch.Tensor, v: torch.Tensor) -> None:
        """Note ``v`` as the value of ``t`` at its current version (see :meth:`_known`)."""
        self._seen[id(t)] = (weakref.ref(t), t._version, v)

    def _in_absmax(
        self, args: Any, kwargs: Any, names: list[tuple[Any, int]] | None = None
    ) -> torch.Tensor | None:
        vals = []
        for path, t in iter_tensors((args, kwargs)):
            if not continuous(t) or t.numel() == 0:
                continue
            v = self._known(t)
            if v is None:
                v = _absmax(t)
                if v is not None:  # the model's input, seen again by each first child
                    self._remember(t, v)
            if v is not None:
                vals.append(v)
                if names is not None:
                    names.append((path, v.numel()))
        if not vals:
            return None
        return vals[0] if len(vals) == 1 else torch.cat(vals)

    def _register(self, name: str, module: nn.Module) -> None:
        stack: list[tuple[int, torch.Tensor | None, list[list[Any]]]] = []
        tracker, scope, detail = self, self.scope, self.detail
        # A module whose backward cannot turn finite gradients into NaN/Inf is never the backward
        # origin, so the sentinel skips its gradient checks (its forward is still checked).
        check_grads = name == "" or not (self.skip_safe and isinstance(module, _BACKWARD_SAFE))

        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if in_backward():
                return None
            if name == "" and tracker.skip_evaluations:  # decided afresh at each model call
                # (a reentrant checkpoint of the whole model runs its forward under no_grad)
                tracker.evaluating = not torch.is_grad_enabled() and not in_reentrant_checkpoint()
            if not tracker.gate[0] or tracker.evaluating:
                return None
            call = tracker.counts.get(name, 0)
            tracker.counts[name] = call + 1
            first = name == "" and tracker.input is None
            paths: list[tuple[Any, int]] | None = [] if first else None
            vin = tracker._in_absmax(args, kwargs, paths)
            if first:
                tracker.input = vin if vin is not None else torch.zeros(2)
                tracker.input_names = paths or []  # named only when one is reported
                tracker.root = weakref.ref(module)
            gouts: list[list[Any]] = []
            stack.append((call, vin, gouts))
            if not check_grads or not torch.is_grad_enabled():
                if check_grads and not tracker.warned_reentrant and in_reentrant_checkpoint():
                    tracker.warned_reentrant = True
                    warnings.warn(
                        f"{tracker.scope.owner}: layer {name!r} runs inside a reentrant activation "
                        "checkpoint (use_reentrant=True), whose forward runs under no_grad: a "
                        "NaN/Inf made in its backward is not located (forward ones still are). "
                        "Checkpoint with use_reentrant=False (hs.apply_checkpointing's default)",
                        HookscopeWarning,
                        stacklevel=2,
                    )
                return None
            if not any(t.requires_grad for _, t in iter_tensors((args, kwargs))):
                return None

            def on_grad_in(g: torch.Tensor, call: int = call) -> None:
                d = _counts(g) if detail else None
                # the same gradient tensor reaches the layers that share an input (a parent
                # and its first child): reduced once
                v = tracker._known(g)
                if v is None:
                    v = _absmax(g)
                    if v is not None:
                        tracker._remember(g, v)
                tracker.bwd.append((name, call, list(gouts), v, d))  # type: ignore[arg-type]

            def on_view(v: torch.Tensor, t: torch.Tensor) -> None:
                scope.add_activation_grad_hook(v, on_grad_in, layer=name)
                known = tracker._known(t)
                if known is not None:  # the same values: the children need not reduce them again
                    tracker._remember(v, known)

            return identity_views(args, kwargs, on_view)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if name == "" and tracker.evaluating:
                tracker.evaluating = False
                return
            if in_backward() or not stack or not tracker.gate[0] or tracker.evaluating:
                return
            call, vin, gouts = stack.pop()
            single = isinstance(output, torch.Tensor)
            # a parent returning its last child's output: reduced already
            vout = tracker._known(output) if single else None
            if vout is None:
                vout = _absmax(output)
            if vout is None:
                return
            if single:  # remembered for the one tensor it describes (not for a tuple's first)
                tracker._remember(output, vout)
            tracker.fwd.append((name, call, vin, vout, _counts(output) if detail else None))
            if not check_grads:
                return
            for _, o in iter_tensors(output):
                if not (o.requires_grad and continuous(o)):
                    continue
                known = tracker._cells.get(id(o))
                if known is not None and known[0]() is o:  # a parent returning its child's output
                    cell = known[1]
                else:
                    cell = [None]
                    tracker._cells[id(o)] = (weakref.ref(o), cell)

                    def on_grad_out(g: torch.Tensor, cell: list[Any] = cell) -> None:
                        # the same gradient tensor may be a child's input gradient already
                        v = tracker._known(g)
                        if v is None:
                            v = _absmax(g)
                            if v is not None:
                                tracker._remember(g, v)
                        cell[0] = v

                    scope.add_activation_grad_hook(o, on_grad_out, layer=name)
                gouts.append(cell)
                if name == "":
                    tracker.root_gout.append(cell)

        scope.add_forward_pre(module, pre, layer=name, with_kwargs=True)
        scope.add_forward(module, post, layer=name, with_kwargs=True)

    def _bad_argument(self, values: list[float]) -> str:
        """The argument of the first input tensor whose values are NaN/Inf (NaN first)."""
        spans, at = [], 0
        for path, n in self.input_names:
            spans.append((path, values[at : at + n]))
            at += n
        root = self.root() if self.root is not None else None
        if at != len(values) or root is None:
            return ""
        for test in (math.isnan, math.isinf):
            for path, v in spans:
                if any(test(x) for x in v):
                    return _argument(root, path)
        return ""

    # -- reading (one host transfer) -----------------------------------------------------------
    def locate(
        self, extra: list[torch.Tensor] | None = None
    ) -> tuple[NonFiniteOrigin | None, list[list[float]]]:
        """The first origin (forward first, then the loss, then backward); also the values of
        the ``extra`` tensors, read in the same host transfer."""
        flat: list[torch.Tensor] = []

        def put(t: torch.Tensor | None) -> int:
            if t is None:
                return -1
            t = t.reshape(-1).float()
            flat.append(t if not flat else t.to(flat[0].device))
            return len(flat) - 1

        inp = put(self.input)
        fwd = [(n, c, put(vi), put(vo), put(d)) for n, c, vi, vo, d in self.fwd]
        root = [put(c[0]) for c in self.root_gout]
        bwd = [
            (n, c, [put(cell[0]) for cell in go], put(vi), put(d)) for n, c, go, vi, d in self.bwd
        ]
        ext = [put(v) for v in (extra or [])]
        if not flat:
            return None, []
        sizes = [t.numel() for t in flat]
        values = torch.cat(flat).tolist()  # the single host sync
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)

        def val(i: int) -> float:
            return _absmax_host(values[starts[i] : starts[i + 1]]) if i >= 0 else 0.0

        def cnt(i: int) -> dict[str, float]:
            return {} if i < 0 else {"nan": values[starts[i]], "inf": values[starts[i] + 1]}

        extra_vals = [values[starts[i] : starts[i + 1]] for i in ext]
        if inp >= 0:
            s = _state(val(inp))
            if s == 2 or (s == 1 and not self.allow_input):
                return NonFiniteOrigin(
                    INPUT,
                    "forward",
                    0,
                    _KIND[s],
                    "",
                    {"input_absmax": val(inp)},
                    self._bad_argument(values[starts[inp] : starts[inp + 1]]),
                ), extra_vals
        for name, call, vi, vo, d in fwd:
            si, so = _state(val(vi)), _state(val(vo))
            if so > si and not (so == 1 and name in self.allowed):
                stats = {"input_absmax": val(vi), "output_absmax": val(vo)}
                stats.update({f"output_{k}": v for k, v in cnt(d).items()})
                return NonFiniteOrigin(
                    name, "forward", call, _KIND[so], self.types.get(name, ""), stats
                ), extra_vals
        for i in root:
            s = _state(val(i))
            if s:
                return NonFiniteOrigin(
                    LOSS, "backward", 0, _KIND[s], "", {"grad_output_absmax": val(i)}
                ), extra_vals
        for name, call, go, vi, d in bwd:
            gmax = max((val(i) for i in go), key=lambda v: (_state(v), v), default=0.0)
            so, si = _state(gmax), _state(val(vi))
            if si > so and not (si == 1 and name in self.allowed):
                stats = {"grad_output_absmax": gmax, "grad_input_absmax": val(vi)}
                stats.update({f"grad_input_{k}": v for k, v in cnt(d).items()})
                return NonFiniteOrigin(
                    name, "backward", call, _KIND[si], self.types.get(name, ""), stats
                ), extra_vals
        return None, extra_vals


def _param_origin(
    tracker: _Tracker,
    params: list[tuple[str, nn.Parameter]],
    order: list[int],
    values: list[list[float]],
) -> NonFiniteOrigin | None:
    """The first parameter gradient (in the order autograd computed them) that is NaN/Inf while
    every activation gradient was finite: made by the backward of the module holding it (a
    ``sqrt(w)`` at ``w = 0``), reported on that module with the parameter named in ``stats``."""
    for j in [*order, *(j for j in range(len(params)) if j not in order)]:
        v = _absmax_host(values[j])
        s = _state(v)
        name, _, pname = params[j][0].rpartition(".")
        if s and not (s == 1 and name in tracker.allowed):
            return NonFiniteOrigin(
                name, "backward", 0, _KIND[s], tracker.types.get(name, ""),
                {f"grad_{pname}_absmax": v},
            )  # fmt: skip
    return None


_SKIP = NonFiniteOrigin("", "", 0, "")  # another rank's forward found one: no backward here


def _agreed(model: nn.Module, origin: NonFiniteOrigin | None, backward: bool) -> Any:
    """Whether the backward runs, decided alike on every rank when ``model``'s backward makes
    collectives (``DTensor`` parameters: FSDP2, tensor parallel; DDP's reducer does not run for
    ``torch.autograd.grad``): a rank returning after its forward (it found an origin there)
    while another runs the backward left that one waiting in the backward's collectives, or
    paired them with its next step's. One ``all_reduce`` of one number: if any rank found an
    origin in its forward pass, every rank skips the backward; this rank's ``origin``, or
    :data:`_SKIP` (with a warning: its backward pass was not checked) where this rank found none.
    """
    import torch.distributed as dist

    if not backward or not (dist.is_available() and dist.is_initialized()):
        return origin
    if dist.get_world_size() == 1 or not any(is_dtensor(p) for _, p in named_parameters(model)):
        return origin
    dev = torch.device("cpu")
    if dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    found = torch.tensor([0 if origin is None else 1], device=dev)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if origin is not None or not int(found.item()):
        return origin
    warnings.warn(
        f"find_nonfinite (rank {dist.get_rank()}): another rank found a NaN/Inf in its forward "
        "pass, so every rank skips the backward pass (the model's backward communicates across "
        "the ranks): this rank's forward pass is finite, its backward pass was not checked. "
        "Run find_nonfinite again on the inputs of the rank that found it",
        HookscopeWarning,
        stacklevel=4,
    )
    return _SKIP


def _blamed(origin: NonFiniteOrigin | None) -> str:
    """What a NaN/Inf made in calls the hooks did not see does to the verdict ``origin``."""
    if origin is None:
        return (
            "a NaN/Inf made in them would have been blamed on the layer that called them, or "
            "missed if that layer's output was finite"
        )
    where = (
        origin.layer
        if origin.layer in (INPUT, LOSS)
        else f"layer {origin.layer or '<root>'!r} ({origin.module_type})"
    )
    return (
        f"the origin found ({where}, {origin.phase} pass) may be wrong: a NaN/Inf made in "
        "them is blamed on the layer that called them, or on a later layer"
    )


def _say_elsewhere(away: dict[str, str], origin: NonFiniteOrigin | None) -> None:
    """Warn that :func:`find_nonfinite`'s hooks left alone the calls of ``away`` (``{layer:
    thread}``), made by a worker thread the model's forward started (hooks act on the calling
    thread's calls only): a NaN/Inf made there is blamed on the layer that called them."""
    outer = [n for n in away if not any(p in away for p in ancestors(n))]
    warnings.warn(
        f"find_nonfinite: layer(s) {some_names([n or '<root>' for n in outer])} ran in thread "
        f"{away[outer[0]]!r}, which the model's forward started and waited on, and its hooks "
        "act only on the calls of the thread that called find_nonfinite (docs/guide/core.md, "
        f"Threads), so they did not see those calls: {_blamed(origin)}; run those layers in "
        "the forward's own thread",
        HookscopeWarning,
        stacklevel=3,
    )


def _say_lost(lost: dict[str, str], origin: NonFiniteOrigin | None) -> None:
    """Warn that :func:`find_nonfinite`'s hooks missed the calls of ``lost`` (``{layer: what
    happened}``: a module the model's forward replaced or built, hooks ``hs.remove_hooks``
    took): a NaN/Inf made there is blamed on the layer that called them."""
    taken = [n for n, v in lost.items() if v.endswith("hs.remove_hooks")]
    moved = [n for n in lost if n not in taken]
    first = (moved or taken)[0]
    said = _blamed(origin)
    if moved:
        what = (
            f"layer(s) {some_names(moved)} changed in the model while find_nonfinite ran it "
            f"({lost[moved[0]]})"
        )
        fix = (
            f"run the model once before find_nonfinite (a forward that builds "
            f"{attribute_path(first)} builds it then), or make the change before"
        )
    else:
        what = (
            f"its hooks on {len(taken)} layer(s) ({some_names([n or '<root>' for n in taken])}) "
            "were removed by hs.remove_hooks(...) while it ran"
        )
        fix = "do not call hs.remove_hooks in the model's forward or loss_fn"
    warnings.warn(
        f"find_nonfinite: {what}, so its hooks did not see their calls: {said}; {fix}",
        HookscopeWarning,
        stacklevel=3,
    )


def _cuda_devices(model: nn.Module, *values: Any) -> list[int]:
    """The CUDA devices the model's tensors and the inputs are on (their generators fork)."""
    found = {t.device.index for t in model.parameters() if t.is_cuda}
    found |= {t.device.index for t in model.buffers() if t.is_cuda}
    found |= {t.device.index for _, t in iter_tensors(values) if t.is_cuda}
    if found and torch.cuda.is_available():
        found.add(torch.cuda.current_device())
    return sorted(i for i in found if i is not None)


def _run_located(
    model: nn.Module,
    tracker: _Tracker,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    backward: bool,
) -> NonFiniteOrigin | None:
    """:func:`find_nonfinite`'s run under ``tracker``'s hooks: the origin, or None."""
    args = map_tensors(
        lambda t: t.detach().requires_grad_() if backward and continuous(t) else t,
        inputs,
    )
    kw = map_tensors(
        lambda t: t.detach().requires_grad_() if backward and continuous(t) else t,
        kwargs,
    )
    with torch.enable_grad() if backward else torch.no_grad():
        out = model(*args, **kw)
        loss = loss_fn(out) if loss_fn is not None else None
    origin, _ = tracker.locate()
    if origin is not None or not backward:
        return _agreed(model, origin, backward)
    if loss is None:
        t = first_tensor(out)
        loss = t.sum() if t is not None else None
    else:
        lt = _absmax(loss)
        lv = _absmax_host(lt.tolist()) if lt is not None else 0.0
        if not math.isfinite(lv):
            return _agreed(
                model,
                NonFiniteOrigin(
                    LOSS,
                    "forward",
                    0,
                    "nan" if math.isnan(lv) else "inf",
                    "",
                    {"loss_absmax": lv},
                ),
                backward,
            )
    if _agreed(model, None, backward) is _SKIP or loss is None:
        return None
    if not loss.requires_grad:
        return None
    params = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
    order: list[int] = []  # the parameters in the order autograd reached them
    for j, (n, p) in enumerate(params):
        tracker.scope.add_tensor_hook(p, lambda g, j=j: order.append(j), layer=n.rpartition(".")[0])
    leaves = [p for _, p in params]
    leaves += [t for _, t in iter_tensors((args, kw)) if t.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    zero = torch.zeros(2)
    pmax = [(_absmax(g) if g is not None else None) for g in grads[: len(params)]]
    origin, pvals = tracker.locate([v if v is not None else zero for v in pmax])
    if origin is None:
        origin = _param_origin(tracker, params, order, pvals)
    return origin


def find_nonfinite(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
    allow: Iterable[Any] = (),
    **kwargs: Any,
) -> NonFiniteOrigin | None:
    """Run ``model(*inputs, **kwargs)`` (and a backward pass) and return where the first NaN/Inf
    was produced, or ``None`` if every value stayed finite.

    The backward pass differentiates ``loss_fn(output)`` (default: the sum of the first output
    tensor) with :func:`torch.autograd.grad`, so no ``.grad`` of the model is changed, and buffers
    (BatchNorm running statistics) and the random number generators (dropout in train mode
    draws from a fork of them) are restored afterwards; floating inputs are given
    ``requires_grad`` (on a detached copy) so the first layer is checked too. The model runs in
    the mode it is in (train/eval), as when the NaN appeared.

    Args:
        model: any ``nn.Module``; every module in it is checked, parents included.
        inputs, kwargs: what to call the model with.
        loss_fn: ``loss_fn(output) -> scalar``; a non-finite loss is reported as :data:`LOSS`.
        backward: also check the backward pass.
        allow: layers allowed to produce infinities (names, globs, types; :data:`INPUT` for the
            model input), e.g. a layer filling an attention mask with ``-inf``. NaN is never allowed.

    A parameter's gradient that is NaN/Inf while every activation gradient stayed finite (a
    ``torch.sqrt(self.w)`` at ``w = 0``: its gradient is Inf, the input's is not) is reported on
    the module holding the parameter (phase ``"backward"``, call 0), ``stats`` naming it:
    ``{"grad_w_absmax": inf}``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> class Log(nn.Module):
        ...     def forward(self, x):
        ...         return torch.log(x)
        >>> net = nn.Sequential(nn.Linear(2, 2), Log(), nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = net[0].weight.copy_(-torch.eye(2)); _ = net[0].bias.zero_()
        >>> origin = hs.find_nonfinite(net, torch.ones(1, 2))
        >>> origin.layer, origin.phase, origin.kind
        ('1', 'forward', 'nan')
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        check_model(model)
        saved = contextlib.ExitStack()  # buffers and plain attributes put back as found
        saved.enter_context(state_kept(model))
        # a train-mode run draws random numbers (dropout): from a fork of the generators, so
        # the caller's run goes on with the numbers it would have drawn without this call
        saved.enter_context(torch.random.fork_rng(devices=_cuda_devices(model, inputs, kwargs)))
        tracker = _Tracker(model, allow, detail=True, owner="find_nonfinite")
        try:
            with tracker.scope:
                origin = _run_located(model, tracker, inputs, kwargs, loss_fn, backward)
                lost = tracker.lost(added=True)  # (a module the forward built or replaced)
            if lost:
                _say_lost(lost, origin)
            if tracker.scope.elsewhere:
                _say_elsewhere(tracker.scope.elsewhere, origin)
            return origin
        finally:
            tracker.scope.remove()
            saved.close()
