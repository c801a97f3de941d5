"""``memory_profile``: the bytes each module saves for backward in one training step."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core._buffers import Attributes, buffers_kept
from ..core._compiled import compiled_regions, named_modules, region_of, strip_compiled
from ..core._errors import HookscopeError, HookscopeWarning, LayerNotFoundError, some_names
from ..core._nested import iter_tensors
from ..core._scope import ancestors, attribute_path, check_model, internal_run
from ..core._select import suggest
from ._saved import CallInputs, SavedTensors, SaveEvent

__all__ = ["MemoryProfile", "MemoryRow", "memory_profile"]


@dataclass
class MemoryRow:
    """One module of a :class:`MemoryProfile` (every depth, in model order).

    Attributes:
        name: the module's name (``""`` for the model itself).
        type: its class name.
        depth: nesting depth (0 for the model).
        calls: how many times it ran in the forward pass.
        saved_bytes: bytes of the storages first saved for backward by operations this module ran
            itself (not inside a child module).
        saved_bytes_total: the same with its children (its whole subtree).
        shared_bytes: of ``saved_bytes``, the bytes of storages that later modules saved too
            (counted here only, once: marked ``*`` in the table).
        param_saved_bytes: bytes of parameters and buffers its own operations saved (apart).
        flops: forward FLOPs of its own operations (what recomputing them costs).
        flops_total: the same with its children.

    In a profile of a ``torch.compile``'d model (``per_region``) the FLOPs are ``None`` (not
    counted), and so are the calls and bytes of a module inside a compiled region (its region's
    row holds them: the compiled graph does not run the module's hooks): ``n/a`` in the table,
    never a measured 0.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> row = hs.memory_profile(nn.Linear(4, 2), torch.randn(3, 4))[""]
        >>> row.saved_bytes, row.flops  # the input (3*4 floats); 2*3*4*2 for the matmul
        (48, 48)
    """

    name: str
    type: str
    depth: int
    calls: int | None = 0
    saved_bytes: int | None = 0
    saved_bytes_total: int | None = 0
    shared_bytes: int | None = 0
    param_saved_bytes: int | None = 0
    flops: int | None = 0
    flops_total: int | None = 0

    @property
    def shared(self) -> bool:
        """Whether a storage counted here was also saved by another module."""
        return bool(self.shared_bytes)


@dataclass
class MemoryProfile:
    """The result of :func:`memory_profile`: one :class:`MemoryRow` per module, and totals.

    ``profile[name]`` is a row; ``profile.rows`` all of them in model order; ``str(profile)`` a
    table (``rich.print(profile)`` renders it with rich); ``profile.plot()`` a bar chart;
    ``profile.plan(budget_bytes)`` the modules to checkpoint.

    Attributes:
        total_saved_bytes: bytes of the unique storages saved for backward in the step
            (parameters and buffers excluded); the ``saved_bytes`` of the rows and
            ``loss_saved_bytes`` add up to it.
        loss_saved_bytes: of those, the bytes first saved after the model returned, by
            ``loss_fn`` (a cross-entropy keeps its log-probabilities): no module saved them, so
            no row holds them and no checkpointing frees them.
        param_saved_bytes: bytes of parameter and buffer storages saved for backward (apart).
        param_bytes: bytes of all the model's parameters and buffers.
        live_bytes_end_forward: bytes of the tensors created in the step still alive when the
            loss is computed (saved activations, outputs, the loss).
        peak_forward_bytes: the most bytes of tensors created in the step alive at once during
            forward; ``peak_backward_bytes`` during backward (gradients included; measured with
            ``backward_peak=True``, else ``None``). Parameters, buffers and the given inputs are
            not counted (they were there before). A compiled model gets no FLOPs nor live
            bytes (the dispatch mode would change what it compiles): the live and peak bytes
            are 0, the rows' FLOPs ``None``.
        per_region: ``True`` for a ``torch.compile``'d model: what is saved is the compiled
            graph's choice, so each compiled region gets one row (its subtree is not split: the
            rows of the modules inside it hold ``None``, not measured).
        excluded: modules that checkpointing would make wrong, with the reason, seen in the
            step: one that changes in place a tensor it did not create (its input, as
            ``ReLU(inplace=True)`` does) or a parameter, or whose input a later operation changes
            in place. :meth:`plan` never picks them (their parents can be).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 1)))
        >>> prof = hs.memory_profile(net, torch.randn(2, 4))
        >>> [(r.name, r.saved_bytes, r.saved_bytes_total) for r in prof]
        [('', 0, 96), ('0', 32, 32), ('1', 0, 64), ('1.0', 64, 64), ('1.1', 0, 0)]
        >>> prof["1.0"].shared  # Tanh's output is also what Linear 1.1 saves: counted once
        True
    """

    model: str
    rows: list[MemoryRow]
    total_saved_bytes: int
    param_saved_bytes: int
    param_bytes: int
    live_bytes_end_forward: int
    peak_forward_bytes: int
    peak_backward_bytes: int | None
    per_region: bool = False
    device: str = "cpu"
    excluded: dict[str, str] = field(default_factory=dict)
    loss_saved_bytes: int = 0
    _events: list[SaveEvent] = field(default_factory=list, repr=False)
    _calls: list[CallInputs] = field(default_factory=list, repr=False)

    # -- rows -------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> MemoryRow:
        for r in self.rows:
            if r.name == name:
                return r
        names = [r.name for r in self.rows]
        raise LayerNotFoundError(
            f"no module {name!r} in this memory profile of {self.model}; closest: "
            + ", ".join(repr(n) for n in suggest(name, names))
        )

    def __iter__(self) -> Iterator[MemoryRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain Python data."""
        import dataclasses

        d = {
            k: getattr(self, k)
            for k in (
                "model",
                "total_saved_bytes",
                "param_saved_bytes",
                "param_bytes",
                "live_bytes_end_forward",
                "peak_forward_bytes",
                "peak_backward_bytes",
                "per_region",
                "device",
                "excluded",
                "loss_saved_bytes",
            )
        }
        d["rows"] = [dataclasses.asdict(r) for r in self.rows]
        return d

    # -- renderings and plan (in their own files) -------------------------------------------------
    def to_text(self, *, depth: int | None = None, width: int = 100) -> str:
        """A plain-text table (``depth`` folds deeper rows away)."""
        from ._render import to_text

        return to_text(self, depth=depth, width=width)

    def __str__(self) -> str:
        return self.to_text()

    def __rich__(self) -> Any:
        from ._render import to_rich

        return to_rich(self)

    def plot(self, *, depth: int | None = 1, ax: Any = None) -> Any:
        """A horizontal bar chart of ``saved_bytes_total`` per module down to ``depth``
        (matplotlib, imported here); returns the figure."""
        from ._render import plot

        return plot(self, depth=depth, ax=ax)

    def plan(self, budget_bytes: int) -> Any:
        """The modules to checkpoint so that the saved bytes fit ``budget_bytes``; see
        :class:`CheckpointPlan`."""
        from ._plan import make_plan

        return make_plan(self, budget_bytes)


def _default_loss(output: Any) -> torch.Tensor:
    parts = [t.float().sum() for _, t in iter_tensors(output) if t.requires_grad]
    if not parts:
        raise HookscopeError(
            "memory_profile: no tensor in the model's output requires grad, so there is no "
            "backward pass to profile; check requires_grad of the parameters, or pass loss_fn="
        )
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def run_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    ops: bool,
    backward_ops: bool = False,
) -> SavedTensors:
    """One forward and backward under a :class:`SavedTensors` recorder. The model is left as found:
    existing ``.grad``, buffers (BatchNorm running statistics, values and the tensors in their
    slots: a forward may reassign one) and plain attributes (a step counter) are put back."""
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    buffers = contextlib.ExitStack()  # buffers put back as found (in place or reassigned)
    buffers.enter_context(buffers_kept(model))
    attributes = Attributes(model)
    for p in params:
        p.grad = None
    rng = torch.random.fork_rng(devices=_cuda_devices(model, inputs, kwargs))
    rng.__enter__()  # the random generators are put back: dropout draws leave no trace
    try:
        # a product's own run (see core._scope.internal_run): a capture or monitor open around
        # the profile neither records its step nor adds its copies to the profile's bytes
        with internal_run(), SavedTensors(model, ops=ops, backward_ops=backward_ops) as rec:
            output = model(*inputs, **kwargs)
            loss = (loss_fn or _default_loss)(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise HookscopeError(
                    f"memory_profile: loss_fn must return a tensor with one element; got "
                    f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
                )
            if not loss.requires_grad:
                raise HookscopeError(
                    "memory_profile: the loss does not require grad, so there is no backward "
                    "pass to profile; loss_fn must compute it from the output without detaching"
                )
            rec.forward_done()
            del output
            loss.backward()
            del loss
    finally:
        rng.__exit__(None, None, None)
        for p, g in zip(params, grads):
            p.grad = g
        buffers.close()
        attributes.restore()
    return rec


def _tensors(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    yield from model.parameters()
    yield from model.buffers()
    for _, t in iter_tensors((inputs, kwargs)):
        yield t


def _cuda_devices(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The CUDA devices whose generators the step may draw from (none before CUDA is used)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    devices = {t.device.index for t in _tensors(model, inputs, kwargs) if t.is_cuda}
    devices.add(torch.cuda.current_device())
    return sorted(d for d in devices if d is not None)


def _check_grad_mode() -> None:
    """Refuse a step that cannot build a graph: under ``inference_mode`` or ``no_grad``."""
    if torch.is_inference_mode_enabled():
        raise HookscopeError(
            "memory_profile needs autograd (it runs a backward pass), which "
            "torch.inference_mode() forbids; call it outside torch.inference_mode()"
        )
    if not torch.is_grad_enabled():
        raise HookscopeError(
            "memory_profile needs autograd (it runs a backward pass), which torch.no_grad() "
            "turns off; call it outside torch.no_grad() (or inside torch.enable_grad())"
        )


def _check_data(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse tensors without data: a ``meta``-device model or input saves nothing measurable."""
    for t in _tensors(model, inputs, kwargs):
        if t.is_meta:
            raise HookscopeError(
                "memory_profile: the model or its inputs are on the 'meta' device (shapes "
                "without data: autograd saves nothing there, every figure would be 0); "
                "materialize the model first (model.to_empty(device='cpu') and load or "
                "initialize its weights) and pass real inputs"
            )


def memory_profile(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward_peak: bool = False,
    **kwargs: Any,
) -> MemoryProfile:
    """Run one training step (forward, loss, backward) and report the bytes each module keeps for
    backward.

    Every tensor autograd saves is seen by ``torch.autograd.graph.saved_tensors_hooks`` and
    charged to the module whose own operation saved it; a storage saved several times (by several
    operations or modules) counts once, for the first module, and is marked there as shared.
    Parameters and buffers are reported apart. FLOPs and live bytes come from a dispatch mode
    watching the same step. The model is left as found: its ``.grad`` and buffers (BatchNorm
    running statistics) are put back, its mode is unchanged (profile in ``model.train()`` for
    training figures), and so are the random generators (CPU and CUDA: dropout draws leave no
    trace). The same dispatch mode sees in-place writes: a module that changes a tensor it did
    not create (its input) or whose input is changed later is listed in
    :attr:`MemoryProfile.excluded`, and plans never checkpoint it. A tensor changed in place
    after autograd saved it, which a plain step refuses in backward, raises
    ``SavedTensorChangedError`` (a ``RuntimeError``) naming the layer that saved it and the one
    that changed it. A model or input on the ``meta`` device (no data) is refused.

    Args:
        model: any ``nn.Module`` (a ``torch.compile``'d one is reported per compiled region).
        *inputs: positional inputs of the model.
        loss_fn: ``loss_fn(output) -> scalar tensor``; default: the sum of the output's tensors.
        backward_peak: also measure the peak during backward (the dispatch mode then watches
            every backward operation too, a Python call per operation: see
            benchmarks/README.md); ``peak_backward_bytes`` is ``None`` without it.
        **kwargs: keyword inputs of the model.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> prof = hs.memory_profile(net, torch.randn(2, 4))
        >>> prof["0"].saved_bytes, prof["1"].saved_bytes, prof.total_saved_bytes
        (32, 64, 96)
    """
    check_model(model)
    _check_grad_mode()
    _check_data(model, inputs, kwargs)
    regions = compiled_regions(model)
    rec = run_step(model, inputs, kwargs, loss_fn, ops=not regions, backward_ops=backward_peak)
    if rec.lost:
        _say_lost(rec.lost)
    if rec.elsewhere:
        _say_elsewhere(list(rec.elsewhere))
    return build_profile(model, rec, per_region=bool(regions))


def _say_lost(lost: dict[str, str]) -> None:
    """Warn that the step's hooks missed the calls of ``lost`` (``{layer: what happened}``):
    what those modules saved and computed is charged to the module that called them."""
    taken = [n for n, v in lost.items() if v.endswith("hs.remove_hooks")]
    moved = [n for n in lost if n not in taken]
    if moved:
        first = moved[0]
        caller = next((p for p in ancestors(first) if p not in lost), "")
        warnings.warn(
            f"memory_profile: layer(s) {some_names(moved)} changed in the model during the "
            f"profiled step ({lost[first]}), so the profile's hooks did not see their calls: "
            f"what they saved for backward and their FLOPs are charged to the module that "
            f"called them ({caller or '<root>'!r} for {first!r}), and their rows count only "
            f"what the module hooked there did. Call the model once before memory_profile (a "
            f"forward that builds {attribute_path(first)} builds it then), or make the change "
            "before profiling",
            HookscopeWarning,
            stacklevel=3,
        )
    if taken:
        warnings.warn(
            f"memory_profile: its hooks on {len(taken)} layer(s) "
            f"({some_names([n or '<root>' for n in taken])}) were removed by "
            "hs.remove_hooks(...) during the profiled step, so what those layers saved after "
            "that is charged to the module that called them (or to no module); do not call "
            "hs.remove_hooks while memory_profile runs (in the model's forward or loss_fn)",
            HookscopeWarning,
            stacklevel=3,
        )


def _say_elsewhere(names: list[str]) -> None:
    """Warn that ``names`` were called from another thread during the step: what they saved,
    computed and allocated is in no row nor total (hooks, ``saved_tensors_hooks`` and the
    dispatch mode act in the calling thread only)."""
    called = set(names)
    outer = [n for n in names if not any(p in called for p in ancestors(n))]
    warnings.warn(
        f"memory_profile: layer(s) {some_names(outer)} ran in another thread than the one "
        "that called memory_profile (a thread the forward starts, nn.DataParallel's replicas), "
        "where its saved_tensors_hooks and dispatch mode do not reach: what they saved for "
        "backward, their FLOPs and their bytes are in no row nor total, so the profile counts "
        "less than the step keeps. Run those layers in the calling thread while profiling (for "
        "nn.DataParallel, profile model.module on one device)",
        HookscopeWarning,
        stacklevel=3,
    )


def _not_measured(rows: list[MemoryRow], modules: dict[str, nn.Module]) -> None:
    """A compiled model's rows: FLOPs not counted; a module inside a compiled region (not its
    root) ran in the compiled graph, which does not run its hooks, so its calls and bytes are
    its region's: ``None``, never a 0 that reads as measured (they were 0 and ``0 B``)."""
    for r in rows:
        r.flops = r.flops_total = None
        module = modules.get(r.name)
        region = region_of(module) if module is not None else None
        if region is not None and region.root is not module:
            r.calls = r.saved_bytes = r.saved_bytes_total = None
            r.shared_bytes = r.param_saved_bytes = None


def build_profile(model: nn.Module, rec: SavedTensors, *, per_region: bool) -> MemoryProfile:
    """Rows from a recorder: each unique storage charged to the first module that saved it."""
    # storage -> (module, bytes)
    first: dict[tuple[torch.device, int], tuple[str | None, int]] = {}
    shared: set[tuple[torch.device, int]] = set()
    param_first: dict[tuple[torch.device, int], str] = {}
    param_nbytes: dict[tuple[torch.device, int], int] = {}
    # owner None: saved outside the model's call (by loss_fn), charged to no module (it was
    # charged to the root as its own operations' saves, silently)
    for e in rec.events:
        owner = e.stack[-1] if e.stack else None
        if e.param:
            param_first.setdefault(e.key, owner or "")
            param_nbytes[e.key] = e.nbytes
            continue
        got = first.get(e.key)
        if got is None:
            first[e.key] = (owner, e.nbytes)
        elif got[0] != owner:
            shared.add(e.key)
    rows: dict[str, MemoryRow] = {}
    for name, module in named_modules(model):
        rows[name] = MemoryRow(
            name,
            type(strip_compiled(module)).__name__,
            0 if not name else name.count(".") + 1,
            rec.call_counts.get(name, 0),
            flops=rec.flops.get(name, 0),
        )
    loss_saved = 0
    for key, (owner, n) in first.items():
        if owner is None:
            loss_saved += n
            continue
        row = rows.get(owner)
        if row is None:  # a module that is not a named submodule (e.g. created during forward)
            row = rows[""]
        row.saved_bytes += n
        if key in shared:
            row.shared_bytes += n
    for key, owner in param_first.items():
        rows.get(owner, rows[""]).param_saved_bytes += param_nbytes[key]
    ordered = list(rows.values())
    for r in ordered:
        r.saved_bytes_total, r.flops_total = r.saved_bytes, r.flops
    for r in reversed(ordered):  # subtree totals: children come after their parent
        if not r.name:
            continue
        # (a parent listed under another name, a shared module: the nearest listed ancestor)
        parent = next(p for p in ancestors(r.name) if p in rows)
        rows[parent].saved_bytes_total += r.saved_bytes_total
        rows[parent].flops_total += r.flops_total
    if per_region:
        _not_measured(ordered, dict(named_modules(model)))
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    device = next((str(p.device) for p in model.parameters()), "cpu")
    return MemoryProfile(
        model=type(strip_compiled(model)).__name__,
        rows=ordered,
        total_saved_bytes=sum(n for _, n in first.values()),
        param_saved_bytes=sum(param_nbytes.values()),
        param_bytes=param_bytes,
        live_bytes_end_forward=rec.live_end_forward,
        peak_forward_bytes=rec.peak_forward,
        peak_backward_bytes=rec.peak_backward if rec.peak_backward_measured else None,
        per_region=per_region,
        device=device,
        excluded={name: why for name, why in rec.unsafe.items() if name},
        loss_saved_bytes=loss_saved,
        _events=rec.events,
        _calls=rec.calls,
    )
