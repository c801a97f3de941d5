"""Sharded parameters: FSDP2 (``fully_shard``) and tensor-parallel ``DTensor`` s (docs/pitfalls.md §19).

A ``DTensor`` parameter is a view of a *full* tensor of which each rank holds a shard. Two facts
decide how hookscope reaches its gradient:

* Tensor parallel (``parallelize_module``): the ``DTensor`` parameter itself is used in the
  forward graph, so a tensor hook on it fires with a ``DTensor`` gradient (before accumulation,
  as for a plain parameter).
* FSDP2: the forward runs on an unsharded copy, so a tensor hook on the sharded parameter never
  fires. FSDP2 reduce-scatters the gradient into ``param.grad`` (a ``DTensor``, averaged over the
  ranks) and then calls the parameter's post-accumulate-grad hooks itself: that is where an edit
  acts, on the gradient of the combined batch.

Ops (:mod:`hookscope.ops`) applied to a ``DTensor`` act on the full tensor through DTensor's own
operators (``clip_norm`` takes the global norm with one all-reduce of the shards' partial norms).
Any other tensor subclass is refused when hooks are attached (:func:`check_tensor_type`): a hook
hookscope cannot prove fires would be a silent no-op.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from ._ddp import DDPGradEditor, ddp_of
from ._errors import HookscopeError, UnsupportedTensorError
from ._gradcheck import FireCheck
from ._nested import iter_tensors
from ._scope import HookScope, in_backward, warn_once

__all__ = [
    "TPLayouts",
    "add_param_grad_editor",
    "as_sharded_like",
    "check_tensor_type",
    "declared_output",
    "dtensor_class",
    "FSDP2_INSTEAD",
    "fsdp1_found",
    "fsdp1_loaded",
    "fsdp1_marked",
    "fsdp1_wrappers",
    "fsdp_managed",
    "is_dtensor",
    "local",
    "output_kind",
    "plan_mesh",
    "replication",
    "warn_tp_shards",
]


@functools.cache
def _dtensor_import() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed support
        return None
    return DTensor


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor``, or ``None`` where torch.distributed is unavailable
    or ``torch.distributed.tensor`` was never imported (then no DTensor can exist, and importing
    it here would cost ~0.5 s of a first ``Monitor`` or scope)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    return _dtensor_import()


_FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"

# what to do instead of FSDP1, for the messages that refuse or warn about it
FSDP2_INSTEAD = (
    "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard; Lightning "
    "ModelParallelStrategy; Accelerate/HF fsdp_version=2)"
)


def fsdp1_loaded() -> bool:
    """Has this program imported FSDP1 (``FullyShardedDataParallel``)?"""
    return _FSDP1_MODULE in sys.modules


def fsdp1_wrappers(model: nn.Module) -> list[str]:
    """Names of the FSDP1 ``FullyShardedDataParallel`` wrappers in ``model`` (``""``: the root).

    FSDP1 keeps each wrapper's parameters as one flat, sharded ``FlatParameter``: the original
    parameters are either gone from ``named_parameters()`` (``use_orig_params=False``) or plain
    tensors holding 1-D slices of the local shard (``use_orig_params=True``), so nothing in their
    type says they are shards. Found by class, looked up only if a program imported FSDP1.
    """
    cls = getattr(sys.modules.get(_FSDP1_MODULE), "FullyShardedDataParallel", None)
    if cls is None:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, cls)]


def fsdp1_marked(params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the parameters FSDP1 marked as its own: its ``FlatParameter`` and, with
    ``use_orig_params=True``, the original parameters (views into it)."""
    return [n for n, p in params if getattr(p, "_fsdp_flattened", False)]


def fsdp1_found(model: nn.Module) -> list[str]:
    """The FSDP1 wrappers in ``model`` (:func:`fsdp1_wrappers`), else its parameters FSDP1 marked
    (:func:`fsdp1_marked`: ``model`` is the module inside a wrapper)."""
    if not fsdp1_loaded():
        return []
    found = [w or "<root>" for w in fsdp1_wrappers(model)]
    return found or fsdp1_marked(model.named_parameters())


def is_dtensor(t: Any) -> bool:
    """Is ``t`` a ``DTensor`` (or a ``DTensor`` parameter)?"""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (detached), or ``t`` detached."""
    return t.to_local().detach() if is_dtensor(t) else t.detach()  # type: ignore[attr-defined]


_PLAIN = (torch.Tensor, nn.Parameter)


def _known(t: torch.Tensor) -> bool:
    if type(t) in _PLAIN or is_dtensor(t):
        return True
    buffer = getattr(nn, "Buffer", None)
    return buffer is not None and type(t) is buffer


def check_tensor_type(t: torch.Tensor, what: str) -> None:
    """Raise :class:`UnsupportedTensorError` for a tensor subclass hookscope does not handle.

    Known: ``torch.Tensor``, ``nn.Parameter`` and ``DTensor`` (FSDP2, tensor parallel).
    ``what`` names the tensor (``"parameter '0.weight'"``).
    """
    if _known(t):
        return
    cls = type(t)
    raise UnsupportedTensorError(
        f"{what} is a {cls.__module__}.{cls.__qualname__}, a tensor subclass hookscope does not "
        "handle: its gradient hooks may never fire, and an edit or statistic would silently be "
        "missing. Supported: torch.Tensor, nn.Parameter, DTensor (FSDP2 fully_shard, tensor "
        "parallel). Exclude it from the selection (e.g. params= or a narrower layer list)"
    )


def fsdp_managed(model: nn.Module, name: str) -> bool:
    """Is parameter ``name`` of ``model`` sharded by FSDP2 (an ancestor module is an ``FSDPModule``)?"""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:
        return False
    module: nn.Module | None = model
    parts = name.split(".")[:-1]
    if isinstance(model, FSDPModule):
        return True
    for part in parts:
        module = getattr(module, part, None)
        if module is None:
            return False
        if isinstance(module, FSDPModule):
            return True
    return False


def replication(t: torch.Tensor, what: str) -> int:
    """How many ranks hold a copy of each element of ``t``'s shard (1 for a fully sharded
    ``DTensor``; the world size for a plain tensor under torch.distributed), so that summing
    ``local sum / replication`` over every rank gives the full tensor's sum.

    Raises :class:`UnsupportedTensorError` for a ``Partial`` placement (the shards are not the
    values) or a mesh whose size does not divide the world's.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not is_dtensor(t):
        return world
    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    if world % mesh.size():
        raise UnsupportedTensorError(
            f"{what} is a DTensor on a mesh of {mesh.size()} ranks in a world of {world}: "
            "hookscope reduces its statistics over the whole world and needs a mesh whose copies "
            "tile it"
        )
    # a mesh smaller than the world is one dimension of a larger one (FSDP2 over the data-parallel
    # dimension of a 2-D mesh): each of its world / size copies holds the same values
    copies = world // mesh.size()
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise UnsupportedTensorError(
                f"{what} is a DTensor with a Partial placement ({placement}): its shards are not "
                "its values; redistribute it (Shard or Replicate) before monitoring it"
            )
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def output_kind(t: torch.Tensor, what: str) -> str:
    """``"replicate"`` or ``"shard"``: the layout a ``DTensor`` output declares by its
    placements (replicated on every mesh dimension, or sharded on one). Raises
    :class:`UnsupportedTensorError` for a ``Partial`` placement (the shards are not the values)."""
    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        raise UnsupportedTensorError(
            f"{what} is a DTensor with a Partial placement ({placements}): its shards are not its "
            "values. Attach hookscope after parallelize_module (its output hooks redistribute "
            "the output first), or redistribute it to Shard/Replicate"
        )
    return "replicate" if all(p.is_replicate() for p in placements) else "shard"


def _layouts_kind(layouts: Any) -> str | None:
    first = layouts[0] if isinstance(layouts, (tuple, list)) and layouts else layouts
    if first is None or not hasattr(first, "is_replicate"):
        return None
    if first.is_partial():
        return "partial"
    return "replicate" if first.is_replicate() else "shard"


def _dist_initialized() -> bool:
    """Whether a ``torch.distributed`` process group is initialised (a tensor-parallel plan's
    device mesh needs one)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def declared_output(module: nn.Module) -> str | None:
    """The layout a tensor-parallel plan declares for ``module``'s output: ``"shard"``,
    ``"replicate"`` (or ``"partial"``), read from the output hook that ``parallelize_module``
    placed (``ColwiseParallel`` / ``RowwiseParallel``: ``output_layouts``; ``SequenceParallel``:
    sharded on the sequence; ``PrepareModuleOutput``: ``desired_output_layouts``). ``None`` for a
    module the plan does not name."""
    for hook in list(module._forward_hooks.values()):
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                obj = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(obj, functools.partial):
                owner = getattr(obj.func, "__qualname__", "").split(".")[0]
                if getattr(obj.func, "__name__", "") != "_prepare_output_fn":
                    continue
                if owner == "SequenceParallel":
                    return "shard"
                if obj.args:
                    kind = _layouts_kind(obj.args[0])
                    if kind is not None:
                        return kind
            layouts = getattr(obj, "desired_output_layouts", None)
            if layouts is not None and type(obj).__module__.startswith("torch.distributed"):
                kind = _layouts_kind(layouts)
                if kind is not None:
                    return kind
    return None


def plan_mesh(module: nn.Module) -> Any:
    """The device mesh a tensor-parallel plan applied to ``module`` with (the one its output hook
    redistributes over), or ``None`` for a module the plan does not name."""
    if declared_output(module) is None:
        return None
    for hook in list(module._forward_hooks.values()):
        code = getattr(hook, "__code__", None)
        cells = getattr(hook, "__closure__", None) or ()
        if code is None or "device_mesh" not in code.co_freevars:
            continue
        mesh = cells[code.co_freevars.index("device_mesh")].cell_contents
        if hasattr(mesh, "get_local_rank"):
            return mesh
    return None


class TPLayouts:
    """Which layer outputs of a tensor-parallel model are shards and which are replicated, from
    what the model declares, in this order:

    1. a ``DTensor`` output: its placements;
    2. a module the parallelize plan names: the plan's output layout (``ColwiseParallel``:
       ``Shard(-1)`` by default, ``RowwiseParallel``: ``Replicate()``, ...);
    3. an output that is the very tensor an earlier layer of this forward pass returned (a
       container returning its last child's output): that layer's layout;
    4. a module whose inputs include outputs of earlier layers: sharded if one of them is (an
       elementwise layer after a ``ColwiseParallel`` one works on the shard);
    5. otherwise the layout of the last layer that ran (the input came through functional code).

    Every rank runs the same code on the same plan, so every rank decides alike.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.declared = {id(m): k for m in model.modules() if (k := declared_output(m)) is not None}
        self._marks: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._last = "replicate"

    def plan_modules(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The modules the plan names (hooked to mark their outputs even when not monitored)."""
        return [(n, m) for n, m in model.named_modules() if id(m) in self.declared]

    def reset(self) -> None:
        """A new forward pass."""
        self._marks.clear()
        self._last = "replicate"

    def _known(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        mark = self._marks.get(id(t))
        return mark[1] if mark is not None and mark[0]() is t else None

    def kind(self, name: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> str:
        """``"shard"`` or ``"replicate"`` for output ``t`` of layer ``name``; remembers it."""
        what = f"the output of layer {name!r}"
        if is_dtensor(t):
            k = output_kind(t, what)
        else:
            declared = self.declared.get(id(module))
            if declared == "partial":
                raise UnsupportedTensorError(
                    f"{what} is declared Partial by the tensor-parallel plan: its shards are not "
                    "its values, so its statistics cannot be combined. Declare Shard or Replicate "
                    "output layouts for it, or exclude it from the monitored layers"
                )
            k = declared or self._known(t)
            if k is None:
                ins = [self._known(a) for a in (args if isinstance(args, tuple) else (args,))]
                ins = [x for x in ins if x is not None]
                k = ("shard" if "shard" in ins else "replicate") if ins else self._last
        self._marks[id(t)] = (weakref.ref(t), k)
        self._last = k
        return k


def warn_tp_shards(
    scope: HookScope,
    model: nn.Module,
    named: dict[str, nn.Module],
    consequence: str = "what is kept for {name!r} (shape {shape}) is a part of the output, not the output",
) -> None:
    """Tensor parallel: warn, once per layer, when a selected layer of ``model`` returns this
    rank's *shard* of its output as a plain tensor (a ``ColwiseParallel`` layer with the default
    ``use_local_output=True``, and the elementwise layers after it): what ``scope``'s owner keeps
    (or edits) would silently be a part of the output, not the output (``consequence`` says
    which, with ``{name}`` and ``{shape}``). Which outputs are shards is read from
    what the plan declares (:class:`TPLayouts`), as the monitor does. A ``DTensor`` output is
    kept as one (``.full_tensor()`` gives the full output) and is not warned about. No hook is
    added to a model without a tensor-parallel plan."""
    if dtensor_class() is None or not _dist_initialized():
        return  # (a plan needs a device mesh, so a process group: none, no walk of the model)
    layouts = TPLayouts(model)
    if not layouts.declared:
        return
    warned: set[str] = set()
    selected = {id(m) for m in named.values()}

    def mark(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return
            t = next((x for _, x in iter_tensors(output) if x.is_floating_point()), None)
            if t is None:
                return
            kind = layouts.kind(name, module, args, t)
            if kind == "shard" and id(module) in selected and not is_dtensor(t):
                warn_once(
                    warned,
                    name,
                    f"{scope.owner}: the output of layer {name!r} is this rank's shard of a "
                    "tensor-parallel output (the plan hands it on as a plain local tensor), so "
                    + consequence.format(name=name, shape=tuple(t.shape))
                    + ". For the full tensor give the plan's layer use_local_output=False (the "
                    "value is then a DTensor: .full_tensor() gives it, and ops act on it whole), "
                    "or gather the shards over the tensor-parallel mesh",
                )

        return hook

    hooked = dict(layouts.plan_modules(model))
    hooked.update(named)
    scope.add_forward_pre(model, lambda module, args: layouts.reset(), layer="", prepend=True)
    for name, module in hooked.items():
        scope.add_forward(module, mark(name), layer=name)


def as_sharded_like(new: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``new`` laid out as ``like``: a full plain tensor (e.g. a replacement gradient) becomes a
    ``DTensor`` with ``like``'s mesh and placements, each rank keeping its own part (no
    communication); a ``DTensor`` or a plain ``like`` is returned as is."""
    if not is_dtensor(like) or is_dtensor(new):
        return new
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        new.detach(),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )


def add_param_grad_editor(
    scope: HookScope,
    model: nn.Module | None,
    name: str,
    param: torch.Tensor,
    on_grad: Callable[[torch.Tensor], torch.Tensor | None],
    check: FireCheck | None = None,
) -> None:
    """Make ``on_grad(grad) -> new_grad | None`` edit parameter ``name``'s gradient, whatever the
    parameter's kind: a tensor hook for a plain or tensor-parallel parameter (the gradient of this
    backward, before accumulation), FSDP2's post-accumulate-grad call for a ``fully_shard``ed one
    (the reduced gradient of the combined batch, in ``param.grad``), the end of the backward pass
    for a parameter of a ``DistributedDataParallel`` model (the averaged gradient, after DDP's
    reducer wrote it, see :mod:`._ddp`). A full plain tensor returned
    for a ``DTensor`` gradient is laid out as the gradient. Refuses unknown tensor subclasses.
    ``check`` (a :class:`FireCheck`) raises at the end of a backward in which the hook did not
    run although ``.grad`` changed."""
    what = f"parameter {name!r}"
    check_tensor_type(param, what)
    if fsdp1_marked([(name, param)]):
        raise UnsupportedTensorError(
            f"{what} is managed by FSDP1 (FullyShardedDataParallel): its gradient is reduced "
            "and sharded outside autograd, as one flat tensor per wrapper, so an edit could not "
            f"act on this parameter's full gradient. {FSDP2_INSTEAD}, where edits act on the "
            "full reduced gradient"
        )
    if check is not None:
        check.watch(name, param)
        edit = on_grad

        def on_grad(g: torch.Tensor) -> torch.Tensor | None:
            check.fired(name)
            return edit(g)

    if model is not None and is_dtensor(param) and fsdp_managed(model, name):
        _add_fsdp_editor(scope, name, param, on_grad, check)
        return
    found = None
    if model is not None and not is_dtensor(param):
        found = ddp_of(model, name, None if check is None else check.helpers)
    if (
        found is not None
    ):  # DDP: edit the averaged gradient, after DDP's reducer (docs/pitfalls.md §18)
        assert model is not None
        if check is None:
            check = FireCheck(scope, model, "edit_grads")
        prefix, ddp = found
        editors = check.helpers.setdefault("ddp", {})
        if id(ddp) not in editors:
            editors[id(ddp)] = DDPGradEditor(scope, ddp, prefix, check)
        editors[id(ddp)].add(name, param, on_grad)
        return

    def hook(g: torch.Tensor) -> torch.Tensor | None:
        new = on_grad(g)
        return None if new is None else as_sharded_like(new, g)

    scope.add_tensor_hook(param, hook, layer=name)


def _add_fsdp_editor(
    scope: HookScope,
    name: str,
    param: torch.Tensor,
    on_grad: Callable[[torch.Tensor], torch.Tensor | None],
    check: FireCheck | None,
) -> None:
    """FSDP2: edit the reduced gradient of this backward in the post-accumulate-grad call.

    FSDP2 adds the reduced gradient into an existing ``.grad`` (gradient accumulation) before any
    hook sees it. To edit this backward's gradient alone, as for a plain parameter, the existing
    ``.grad`` is set aside when the backward pass starts (so FSDP2 writes a fresh one), and added
    back after the edit (or at the end of the backward, for a parameter that got no gradient).
    Under ``set_requires_gradient_sync(False)`` FSDP2 reduces once, the sum over the micro-steps:
    the edit then applies to that sum.
    """
    held: list[torch.Tensor] = []  # the .grad set aside in this backward
    started = [False]  # set_aside ran for the backward in progress
    left: list[weakref.ref[torch.Tensor]] = []  # the .grad this editor wrote last

    def set_aside() -> None:
        started[0] = True
        if param.grad is not None:
            held[:] = [param.grad]
            param.grad = None

    def put_back() -> None:
        started[0] = False
        if held:
            prev = held.pop()
            if param.grad is None:
                param.grad = prev

    def after_reduce(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if not started[0] and left and left[0]() is g:
            raise HookscopeError(
                f"parameter {name!r}: FSDP2 added this backward's gradient into a .grad that "
                "hookscope had already edited, so the edit would apply to their sum (this backward "
                "did not start from the model's output, where hookscope sets .grad aside). Call "
                "optimizer.zero_grad() between steps, or run backward from the model's output"
            )
        new = on_grad(g)
        if new is not None and new is not g:
            g = as_sharded_like(new, g)
        if held:
            prev = held.pop()
            prev.to_local().add_(g.to_local())  # type: ignore[attr-defined]
            g = prev
        p.grad = g
        left[:] = [weakref.ref(g)]

    if check is not None:
        check.at_start(set_aside)
        check.at_end(put_back)
    scope.add_post_accumulate_grad(param, after_reduce, layer=name)
