"""One run of a model, recorded for comparison: every module call (eager names) with its inputs,
output, output gradient and input gradient (through that call only), the call tree, the order in
which calls start and end, and the parameter gradients of the whole run.

Values and the call tree come from :class:`~._hooks.CallHooks` on every module (one pre-hook and one
post-hook each), kept in a :class:`~._store.ValueStore` (memory up to ``max_bytes``, then disk).
The model is left as found: parameter ``.grad`` and buffers (BatchNorm running statistics) are put
back after the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..core._buffers import ParamVersions, state_kept
from ..core._compiled import compiled_regions, is_optimized, named_modules, named_parameters
from ..core._errors import HookscopeError, some_names
from ..core._nested import map_tensors, object_copier, tensors_of
from ..core._random import draw_fix, draw_place, random_draws
from ..core._scope import HookScope, check_model
from ._hooks import CallHooks
from ._store import ValueStore
from ._tolerance import narrowed

__all__ = [
    "CallRec",
    "CompareError",
    "RunRecord",
    "Leaves",
    "at_path",
    "calls_of",
    "cast_like",
    "in_place_compiled",
    "model_dtype",
    "modes_of",
    "preserved",
    "qualified",
    "quantized_modules",
    "quantized_shown",
    "record_run",
    "restore_aliases",
]


class CompareError(HookscopeError):
    """Two runs cannot be compared as asked (a model that draws random numbers, bad inputs)."""


class CallRec:
    """One module call of a recorded run. ``grad``/``in_grad``: one entry per tensor leaf of the
    output / of ``(args, kwargs)`` (``None`` where no gradient reached it), or ``None`` when the
    run had no backward. The values live in a :class:`~._store.ValueStore` (memory or disk)."""

    __slots__ = (
        "alias",
        "children",
        "end",
        "in_dtypes",
        "in_shapes",
        "index",
        "name",
        "parent",
        "start",
        "store",
    )

    def __init__(
        self,
        name: str,
        index: int,
        start: int,
        parent: int | None,
        alias: list[int] | None = None,
        store: ValueStore | None = None,
    ) -> None:
        self.name, self.index, self.start, self.parent, self.alias = (
            name,
            index,
            start,
            parent,
            alias,
        )
        self.end = -1
        self.children: list[int] = []
        self.store = store if store is not None else ValueStore()
        self.in_dtypes: list[torch.dtype] | None = None  # inputs not kept: their dtypes
        self.in_shapes: list[tuple[int, ...]] | None = None  # and their shapes

    @property
    def input_dtypes(self) -> Any:
        """What the inputs' dtypes can be read from: the dtypes kept, else the inputs."""
        return self.in_dtypes if self.in_dtypes is not None else self.inputs

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.index)

    def _get(self, kind: str) -> Any:
        return self.store.get(f"{kind}{self.start}")

    def _put(self, kind: str, value: Any) -> None:
        self.store.put(f"{kind}{self.start}", value)

    inputs = property(lambda self: self._get("in"), lambda self, v: self._put("in", v))
    output = property(lambda self: self._get("out"), lambda self, v: self._put("out", v))
    grad = property(lambda self: self._get("grad"), lambda self, v: self._put("grad", v))
    in_grad = property(lambda self: self._get("ingrad"), lambda self, v: self._put("ingrad", v))


@dataclasses.dataclass
class RunRecord:
    """A recorded run: calls in start order, ``by_key[(name, index)]`` their positions."""

    calls: list[CallRec]
    by_key: dict[tuple[str, int], int]
    param_grads: dict[str, torch.Tensor | None]
    dtype: torch.dtype
    autocast: torch.dtype | None = None
    compiled: bool = False
    output: Any = None
    loss: float | None = None
    has_grads: bool = False
    modules: dict[str, nn.Module] | None = None  # None for a run read back from disk
    params: dict[str, str] = dataclasses.field(default_factory=dict)  # param -> owning module
    world: int = 1  # ranks joined into this run (a record made under torch.distributed)
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why not paired
    notes: dict[int, str] = dataclasses.field(default_factory=dict)  # pos -> why no values
    # a record of format 1: no gradient where an in-place op followed a module (its identity
    # views lost their hooks), so a gradient it lacks is not a zero one
    partial_grads: bool = False
    # gradients PyTorch never handed over (a view changed in place): key -> module
    lost: dict[str, str] = dataclasses.field(default_factory=dict)
    # modules called by another thread during the run (not recorded): module -> thread
    elsewhere: dict[str, str] = dataclasses.field(default_factory=dict)
    # each module's [training, reads self.training] (None: a record made before they were kept)
    modes: dict[str, list[bool]] | None = None
    # parameters the recorded run also used outside the model's call (a loss term on them):
    # their .grad holds that use
    outside: set[str] = dataclasses.field(default_factory=set)
    # calls whose values the recorded loss used besides the model's output (an auxiliary term
    # on an activation): what reached them is more than their callers' output gradients give
    loss_inside: set[int] = dataclasses.field(default_factory=set)
    # parameters the record's block changed after the model's call (an optimizer step): the
    # CRC-32 of their new values (a live model holding those is not the recorded run's)
    moved: dict[str, int] = dataclasses.field(default_factory=dict)
    # the same parameters' new values cast to other floating dtypes: dtype name -> CRC-32
    moved_cast: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    model: str = ""  # the model's class name
    # the model's quantized modules and their classes, for messages ("": none)
    quantized: str = ""

    @property
    def run_dtype(self) -> torch.dtype:
        """The dtype the run computes in: the autocast dtype, else the parameters'."""
        return self.autocast or self.dtype


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter (float32 when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def cast_like(
    obj: Any, dtype: torch.dtype, device: torch.device | None = None, objects: bool = False
) -> Any:
    """``obj`` with floating tensors cast to ``dtype`` (and every tensor moved to ``device``);
    ``objects``: also those inside the objects among it (a cache passed in: copied, its tensors
    cast, where they are not already in ``dtype`` on ``device``)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if device is not None and t.device != device:
            t = t.to(device)
        return narrowed(t, dtype) if t.is_floating_point() else t

    if objects and any(
        (t.is_floating_point() and t.dtype != dtype) or (device is not None and t.device != device)
        for t in _object_tensors(obj)
    ):
        return map_tensors(one, obj, object_copier(one))
    return map_tensors(one, obj)


def _object_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors held by the objects among ``obj`` (not its own leaves): a cache's."""
    found: list[torch.Tensor] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    copier = object_copier(note)
    map_tensors(lambda t: t, obj, copier)
    return found


def at_path(obj: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` (as :func:`~hookscope.core._nested.iter_tensors` gives it)."""
    for k in path:
        if obj is None:
            return None
        if isinstance(obj, (list, tuple)) or (
            hasattr(obj, "__getitem__") and not hasattr(obj, "__dataclass_fields__")
        ):
            try:
                obj = obj[k]
                continue
            except (KeyError, IndexError, TypeError):
                pass
        obj = getattr(obj, k, None)
    return obj


_QUANTIZED_PACKAGES = (
    "torch.ao.nn.quantized",
    "torch.nn.quantized",
    "torch.ao.nn.intrinsic.quantized",
    "torch.nn.intrinsic.quantized",
    "torchao.",
)


def quantized_modules(model: nn.Module) -> list[str]:
    """The modules of ``model`` that compute on quantized weights: PyTorch's quantized modules
    (``quantize_dynamic``'s ``DynamicQuantizedLinear``, a converted static model), torchao's,
    and any module holding a quantized parameter or buffer. Names as ``named_modules`` gives
    them (``"<root>"`` for the root)."""
    found: list[str] = []
    for name, m in named_modules(model):
        if any(name.startswith(f"{f}.") or f == "<root>" for f in found):
            continue  # inside a quantized module (its packed parameters): the module is named
        cls = type(m)
        quantized = cls.__module__.startswith(_QUANTIZED_PACKAGES) or hasattr(m, "_packed_params")
        if not quantized:
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None and (t.is_quantized or "quant" in type(t).__name__.lower()):
                    quantized = True
                    break
        if quantized:
            found.append(name or "<root>")
    return found


def qualified(cls: type) -> str:
    """``torch.ao.nn.quantized.dynamic.Linear`` for a class whose own name says too little."""
    path = cls.__module__.split(".modules.")[0] if ".modules." in cls.__module__ else cls.__module__
    return f"{path}.{cls.__qualname__}"


def quantized_shown(model: nn.Module) -> str:
    """The quantized modules of ``model`` and their classes, for messages (``""``: none)."""
    found = quantized_modules(model)
    if not found:
        return ""
    kinds = sorted(
        {qualified(type(m)) for n, m in named_modules(model) if (n or "<root>") in found}
    )
    return f"{some_names(found)} ({', '.join(kinds[:3])})"


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[ParamVersions]:
    """Put back parameter ``.grad``, buffers and plain attributes as found, on exit (through
    :func:`~hookscope.core._buffers.state_kept`: the buffers' values, and the buffers themselves
    where the forward replaced, added or resized one; a step counter, a tensor attribute, the
    contents of a list an attribute holds): each run starts from the state the first one did."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    try:
        with state_kept(model) as versions:
            yield versions
    finally:
        for p, g in grads:
            p.grad = g


class Leaves:
    """The store of one recorded call as :class:`CallRec` reads it: ``grad<k>``/``ingrad<k>`` put
    together from the per-leaf values the hooks stored (``None`` where no gradient came)."""

    __slots__ = ("n_in", "n_out", "pos", "store")

    def __init__(self, store: Any, pos: int, n_in: int, n_out: int) -> None:
        self.store, self.pos, self.n_in, self.n_out = store, pos, n_in, n_out

    def get(self, key: str, default: Any = None) -> Any:
        if key.startswith("grad"):
            return [self.store.get(f"{key}_{i}") for i in range(self.n_out)]
        if key.startswith("ingrad"):
            return [self.store.get(f"{key}_{i}") for i in range(self.n_in)]
        return self.store.get(key, default)

    def put(self, key: str, value: Any) -> None:
        raise CompareError("a recorded call is read-only")


def calls_of(entries: list[Any], store: Any) -> list[CallRec]:
    """The :class:`CallRec` of each recorded call (:class:`~._hooks.Entry` objects, or their
    JSON form), reading its values from ``store``."""
    calls = []
    for pos, e in enumerate(entries):
        if isinstance(e, dict):
            name, index, parent, alias = e["name"], e["index"], e["parent"], e["alias"]
            end, children, n_in, n_out = e["end"], e["children"], e["n_in"], e["n_out"]
            dtypes = shapes = None
        else:
            name, index, parent, alias = e.name, e.index, e.parent, e.alias
            end, children, n_in, n_out = e.end, e.children, e.n_in, e.n_out
            dtypes, shapes = e.in_dtypes, e.in_shapes
        c = CallRec(name, index, pos, parent, alias=alias, store=Leaves(store, pos, n_in, n_out))
        c.end, c.children, c.in_dtypes, c.in_shapes = end, list(children), dtypes, shapes
        calls.append(c)
    return calls


def restore_aliases(value: Any, alias: list[int] | None) -> Any:
    """``value`` with leaf ``i`` replaced by leaf ``alias[i]`` (the same object again)."""
    if alias is None:
        return value
    leaves = tensors_of(value)
    it = iter(range(len(leaves)))
    return map_tensors(lambda _t: leaves[alias[next(it)]], value)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


@dataclasses.dataclass
class RunSpec:
    """What to run: the model, its inputs (cast here), the loss and the autocast dtype."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    autocast: torch.dtype | None = None
    what: str = "a"
    max_bytes: int | None = None
    inputs: bool = True  # keep each call's inputs (else their dtypes; a compiled model keeps them)


def record_run(spec: RunSpec) -> RunRecord:
    """Run ``spec.model`` once (forward, and backward of ``loss_fn``) recording every module call."""
    model = spec.model
    modules = dict(named_modules(model))
    dtype, device = model_dtype(model), _device(model)
    # a cache object passed in holds tensors too: cast with the others (B's own copy)
    args = cast_like(spec.args, dtype, device, objects=True)
    kwargs = cast_like(spec.kwargs, dtype, device, objects=True)
    want_grads = spec.loss_fn is not None
    check_model(model)  # index compiled regions first: hooks inside them are routed
    store = ValueStore(spec.max_bytes)
    compiled = is_optimized(model) or bool(compiled_regions(model))
    hooks = CallHooks(
        modules, HookScope("compare"), store, _clone, inputs=spec.inputs or compiled, share=True
    )
    loss = None
    # draws are checked apart in the forward, the loss and the backward: each has its own fix
    with (
        preserved(model) as versions,
        hooks.scope,
        store,  # closed after the run; its temporary file removed where the run raised
        random_draws(model, args, kwargs) as draws,
    ):
        with _autocast(device, spec.autocast):
            out = model(*args, **kwargs)
        if spec.loss_fn is not None:
            with random_draws() as in_loss, _autocast(device, spec.autocast):
                loss_t = spec.loss_fn(out)
            _check_loss_value(loss_t, spec.what)
            if in_loss.drew:
                raise CompareError(
                    "hs.compare: loss_fn draws random numbers (torch.randn_like, a sampled target), "
                    "so each run gets another loss and their gradients differ by chance; make "
                    "loss_fn deterministic (a fixed target, or a generator seeded inside it)"
                )
            try:
                loss_t.backward()
            except RuntimeError as exc:
                if compiled and "modified by an inplace operation" in str(exc):
                    raise CompareError(in_place_compiled(model, spec.what)) from exc
                raise
            loss = float(loss_t.detach())
        # the run's own .grad tensors (no copy): preserved() puts the earlier ones back on exit
        param_grads = {
            n: (None if p.grad is None else p.grad.detach()) for n, p in named_parameters(model)
        }
        # a forward that changes its own weights in place (a clamp_ for weight clipping) would
        # start every later run and replay from other weights (raised inside the block: before
        # state_kept's exit, which would warn as well)
        moved = versions.moved()
        if moved:
            raise CompareError(
                f"hs.compare: model {spec.what!r} ({type(model).__name__}) changes its own "
                f"parameters in place during its forward or backward ({some_names(moved)}: a "
                "clamp_ for weight clipping, a normalisation written back under no_grad), so each "
                "run and replay would start from other weights (the model is left so changed, as "
                "any of its forwards leaves it); compare copies whose forward leaves the "
                "parameters as they are (move that update out of forward, after the step)"
            )
    if draws.drew:
        raise CompareError(_draws_message(spec, args, kwargs, device))
    hooks.checked(None)
    calls = calls_of(hooks.entries, store)
    owners = {}
    for mname, m in modules.items():
        for pname, _ in m.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = mname
    return RunRecord(
        model=type(model).__name__,
        calls=calls,
        by_key={c.key: i for i, c in enumerate(calls)},
        param_grads=param_grads,
        dtype=dtype,
        autocast=spec.autocast,
        compiled=compiled,
        output=map_tensors(lambda t: t.detach(), out),
        loss=loss,
        has_grads=want_grads,
        modules=modules,
        params=owners,
        partial_grads=bool(hooks.lost),
        lost=dict(hooks.lost),
        elsewhere=dict(hooks.elsewhere),
        modes=modes_of(model),
    )


def modes_of(model: nn.Module) -> dict[str, list[bool]]:
    """Each module's ``[training, reads self.training]`` (what ``check_modes`` compares; a record
    keeps it in its index.json)."""
    return {name: [m.training, reads_training(m)] for name, m in named_modules(model)}


def reads_training(module: nn.Module) -> bool:
    """Whether the module's own forward reads ``self.training`` (BatchNorm, dropout, most
    attention modules): its computation may depend on the mode."""
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is not None and "training" in code.co_names


def _draws_message(spec: RunSpec, args: Any, kwargs: Any, device: torch.device) -> str:
    """Why a model that drew random numbers is refused: where (its forward run again, each
    module call watched) and the fix that applies there."""
    model = spec.model

    def again() -> None:
        with _autocast(device, spec.autocast):
            model(*args, **kwargs)

    with preserved(model):
        where = draw_place(model, again, args, kwargs)
    return (
        f"hs.compare: model {spec.what!r} ({type(model).__name__}) draws random numbers{where}, "
        f"so two runs cannot be compared value by value; {draw_fix(model)}"
    )


def in_place_compiled(model: nn.Module, what: str, who: str = "hs.compare") -> str:
    """Why a compiled model's backward failed under the record's hooks on a tensor changed in
    place (PyTorch's message names no module): the modules that work in place, and the fix."""
    names = [n or "<root>" for n, m in named_modules(model) if getattr(m, "inplace", False) is True]
    where = (
        f"modules working in place: {some_names(names)}; set their inplace=False for the "
        "comparison (for m in model.modules(): m.inplace = False where it has one)"
        if names
        else "its code changes a tensor in place (out += x, x.relu_()); write that out of place "
        "for the comparison"
    )
    return (
        f"{who}: model {what!r} is compiled and its backward failed under the record's "
        "hooks (PyTorch: a value needed for the gradient was modified by an inplace "
        f"operation); {where}, or compare its eager copy"
    )


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _check_loss_value(loss: Any, what: str) -> None:
    """``loss_fn`` must give a scalar tensor that backward can start from."""
    if not isinstance(loss, torch.Tensor):
        got = f"a {type(loss).__name__}"
    elif loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}"
    elif not loss.requires_grad:
        got = "a tensor that does not require grad (detached, or made under torch.no_grad())"
    else:
        return
    raise CompareError(
        f"hs.compare: loss_fn gave {got} on the output of model {what!r}; it must return a "
        "scalar tensor computed from the output (e.g. lambda o: o.float().pow(2).sum())"
    )
