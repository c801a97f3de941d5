"""``hs.record``: write what ``hs.compare`` needs of a run to a folder, as the run goes.

The hooks are :class:`~._hooks.CallHooks` (the ones ``hs.compare`` records a live run with); each
value goes to disk when it exists, appended to ``values.bin`` (a :class:`~._store.Spool`): a module
call's inputs when it starts (before the module can change them in place), its output when it
ends, during backward the gradient of each output leaf (what the callers send back) and of each
input leaf through this call only. At exit: the parameter gradients (``params.pt``) and
``index.json`` (the call tree, the order calls ended, dtypes, where each value lies in
``values.bin``). Nothing of the run is held in memory. Records of format 1 (one ``torch.save``
file per value, written before this format) are still read.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
import threading
import uuid
import weakref
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .._version import __version__
from ..core._buffers import version_of
from ..core._compiled import (
    compiled_regions,
    is_optimized,
    named_modules,
    named_parameters,
    strip_compiled,
)
from ..core._errors import enter_once, some_names
from ..core._nested import tensors_of
from ..core._random import GeneratorStates, generators_of, training_modules
from ..core._scope import (
    HookScope,
    _Hook,
    acts_here,
    check_model,
    get_ident,
    graph_task_id,
    quiet,
    thread_checked,
)
from ..core._select import resolve
from ._hooks import CallHooks
from ._ranks import REDUCTIONS, join_ranks
from ._run import (
    CompareError,
    RunRecord,
    calls_of,
    in_place_compiled,
    model_dtype,
    modes_of,
    quantized_shown,
)
from ._store import SPOOL, Spool, SpoolReader, ValueStore, _describe, _raw, cpu_copy

__all__ = ["Record", "load_record", "of_ranks", "record", "unwrapped", "weights_crc"]

_VERSION = 2


class Record:
    """The context manager :func:`record` returns; after the block, ``calls`` is the number of
    module calls written and ``folder`` where."""

    def __init__(self, model: nn.Module, folder: Path, layers: Any) -> None:
        self.folder = folder
        self.calls = 0
        # DistributedDataParallel, DataParallel: hooks on the wrapped model, so names carry no
        # "module." prefix
        model = unwrapped(model)
        self.rank, self.world = _rank_world()
        self._dir = folder / f"rank{self.rank}" if self.world > 1 else folder
        self._model = model
        self._layers = layers
        self._scope = HookScope("record")
        self._hooks: CallHooks | None = None
        self._spool: Spool | None = None
        self._watch = _Watch(_device_type(model))

    def __enter__(self) -> Record:
        enter_once(self, "record", self._scope.active)
        model = self._model
        check_model(model)
        named = dict(named_modules(model)) if self._layers is None else resolve(model, self._layers)
        # one process: nor a record of several ranks (their folders) already in it
        taken = (self.folder, self._dir) if self.world > 1 else (self.folder, self.folder / "rank0")
        if any((d / "index.json").exists() for d in taken):
            raise CompareError(
                f"hs.record: {str(self.folder)!r} already holds a record; give an empty folder"
            )
        # a file of the user's under a name the record writes would be replaced: refused
        for name in ("params.pt", "index.json.tmp"):
            if (self._dir / name).exists():
                raise CompareError(
                    f"hs.record: {str(self._dir)!r} already holds {name}, a file the record "
                    "writes (it would be replaced); give an empty folder, or move that file"
                )
        if self.world > 1:  # another rank's record of another run (another number of ranks)
            for other in sorted(self.folder.glob("rank*/index.json")):
                try:
                    world = json.loads(other.read_text()).get("world")
                except (OSError, ValueError):
                    world = None
                if world != self.world:
                    raise CompareError(
                        f"hs.record: {str(self.folder)!r} already holds a record of "
                        f"{world if world is not None else 'another number of'} ranks "
                        f"({other.parent.name}); this run has {self.world}: give an empty folder"
                    )
        meta = [n for n, p in named_parameters(model) if p.device.type == "meta"]
        if meta:
            raise CompareError(
                f"hs.record: the model's parameters {some_names(meta)} are on the meta device "
                "(shapes without values), so its run has no values to record; make it real "
                "first (model.to_empty(device='cpu'), then load its weights)"
            )
        for p in model.parameters():
            if p.grad is not None:
                raise CompareError(
                    "hs.record: the model's parameters already hold gradients; call "
                    "model.zero_grad(set_to_none=True) first, so the record holds this run's"
                )
        self._dir.mkdir(parents=True, exist_ok=True)
        self._run = _run_id() if self.world > 1 else None
        self._owners = {
            (f"{n}.{p}" if n else p): n
            for n, m in named_modules(model)
            for p, _ in m.named_parameters(recurse=False)
        }
        self._spool = Spool(self._dir)
        # a record of the other kind being written into the folder (one process / ranks): each
        # looks for the other's file after creating its own, so of two started at once, at least
        # one sees the other
        if self.world > 1:
            other = [self.folder / n for n in (SPOOL, "index.json") if (self.folder / n).exists()]
        else:
            other = [p for p in self.folder.glob(f"rank*/{SPOOL}") if p.parent.name[4:].isdigit()]
        if other:
            self._spool.close()
            self._spool.path.unlink(missing_ok=True)
            raise CompareError(
                f"hs.record: {str(self.folder)!r} already holds "
                + ("a record of one process" if self.world > 1 else "records of ranks")
                + f" ({other[0].relative_to(self.folder)}), written or being written; this run "
                + ("has " + str(self.world) + " ranks" if self.world > 1 else "is one process")
                + ": give an empty folder"
            )
        try:
            self._hooks = CallHooks(
                named, self._scope, self._spool, _detached, strip_compiled(model)
            )
            self._watch.place(self._scope, strip_compiled(model), self.world)
        except BaseException:  # no record: no hooks, no empty values.bin to refuse the next one
            self._scope.remove()
            self._spool.close()
            self._spool.path.unlink(missing_ok=True)
            raise
        params = {id(p): (n, p) for n, p in named_parameters(model) if p.requires_grad}
        self._watch.outside = _Outside(params, self._scope.id)
        # the walk of a loss's graph stops at any value a module call handed on, too (a loss on
        # an activation a module kept reaches the parameters through the calls' own gradients)
        self._hooks.nodes = self._watch.outside.handed
        self._watch.outside.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._scope.remove()
        self._leave_mode()
        spool, hooks = self._spool, self._hooks
        assert spool is not None and hooks is not None
        # the autograd nodes the loss's walk stops at: not held past the block (a forward-only
        # run's graph, its saved activations, would live as long as this object)
        hooks.nodes = None
        if self._watch.outside is not None:
            self._watch.outside.ends.clear()
            self._watch.outside.handed.clear()
        # what this record writes: removed again unless index.json, written last, is in place
        # (a disk that filled, an interrupt while writing: never a partial record, nor files
        # that refuse the next record into this folder as if it were running)
        written = (spool.path, self._dir / "params.pt", self._dir / "index.json.tmp")
        kept = False
        try:
            kept = self._finish(hooks, spool, exc)
        except OSError as err:
            left = _remove(written)
            raise CompareError(
                f"hs.record: writing the record into {str(self._dir)!r} failed "
                f"({type(err).__name__}: {err}); no record was kept"
                + (f" (delete what is left of it: {', '.join(left)})" if left else "")
                + ": free space (or make the folder writable) and record again"
            ) from err
        finally:
            if not kept:
                _remove(written)

    def _finish(self, hooks: CallHooks, spool: Spool, exc: BaseException | None) -> bool:
        """Close the values and, for a block that ended normally with a run a record can hold,
        write ``params.pt`` and ``index.json`` (last); whether the record was kept."""
        try:
            spool.close()  # (a disk that filled: the buffer's last bytes fail here)
        except Exception:
            if exc is None:
                raise
        if exc is not None:  # no record (the caller's error goes on)
            if (
                isinstance(exc, RuntimeError)
                and "modified by an inplace operation" in str(exc)
                and (is_optimized(self._model) or compiled_regions(self._model))
            ):  # (PyTorch's message names no module)
                raise CompareError(
                    in_place_compiled(
                        self._model, type(strip_compiled(self._model)).__name__, "hs.record"
                    )
                ) from exc
            return False
        hooks.checked(None)
        why = self._refused(hooks, spool)
        if why is None and hooks.grads:
            why = self._quantized()
        if why is not None:  # no record: a run it cannot hold as one forward and its backward
            raise CompareError(f"hs.record: {why}; nothing was written to {str(self._dir)!r}")
        params = {n: _full(p.grad) for n, p in named_parameters(self._model)}
        buf = io.BytesIO()
        torch.save(params, buf)
        (self._dir / "params.pt").write_bytes(buf.getbuffer())
        index = {
            "version": _VERSION,
            "model": type(self._model).__name__,
            "dtype": str(model_dtype(self._model)).removeprefix("torch."),
            "autocast": _dtype_name(self._watch.autocast),
            "grads": hooks.grads or any(v is not None for v in params.values()),
            "params": self._owners,
            "calls": [e.to_json() for e in hooks.entries],
            "model_calls": hooks.model_calls,
            "rank": self.rank,
            "world": self.world,
            "run": self._run,
            "values": spool.index,
            "lost": hooks.lost,
            "elsewhere": hooks.elsewhere,
            "modes": modes_of(self._model),
            # its quantized modules (compare says their errors are quantization's)
            "quantized": quantized_shown(self._model),
            # parameters used outside the model's call with gradients on (a loss term on them)
            "outside": sorted(self._watch.outside.used) if self._watch.outside else [],
            # calls whose handed-on values the loss used besides the model's output (an
            # auxiliary term on an activation): their callers' local backward lacks that path
            "loss_inside": sorted(self._watch.outside.inside) if self._watch.outside else [],
            # parameters changed in the block after the model's call (an optimizer step): a
            # checksum of their new values, so that a live model holding those is refused
            "moved": self._watch.moved_sums(),
            # the same, of those values cast to the other floating dtypes (a bf16 copy of the
            # stepped model is the stepped model too)
            "moved_cast": self._watch.moved_cast_sums(),
            # what the other two files hold, checked when read: a file changed after the record,
            # or one of another record put beside this index, is refused
            "checksums": {
                SPOOL: [spool.crc, spool.size],
                "params.pt": [zlib.crc32(buf.getbuffer()), buf.getbuffer().nbytes],
            },
        }
        # and the index itself: an edit (two values' places swapped) would read as other values
        index["checksums"]["index.json"] = _index_crc(json.loads(json.dumps(index)))
        tmp = self._dir / "index.json.tmp"
        tmp.write_text(json.dumps(index))
        os.replace(tmp, self._dir / "index.json")
        self.calls = len(hooks.entries)
        return True

    def _quantized(self) -> str | None:
        """A backward through quantized modules: PyTorch's quantized kernels have none, so no
        gradient reached the modules before them (recorded as missing: compared nowhere)."""
        shown = quantized_shown(self._model)
        if not shown:
            return None
        return (
            f"the block ran a backward through quantized modules {shown}: PyTorch's quantized "
            "kernels have no backward, so no gradient reached the modules before them; record "
            "the forward only (no backward in the block), or record the float model"
        )

    def _leave_mode(self) -> None:
        """Take the watch's torch function mode off the stack (where it is: the block may have
        left another mode above it)."""
        mode, watch = self._watch.outside, self._watch
        if mode is None:
            return
        if watch.popped:  # an exception left the model's call without its post-hook
            watch.popped = False
            return
        n = torch._C._len_torch_function_stack()
        held = [torch._C._pop_torch_function_stack() for _ in range(n)][::-1]
        for m in held:
            if m is not mode:
                torch._C._push_on_torch_function_stack(m)

    def _refused(self, hooks: CallHooks, spool: Spool) -> str | None:
        """Why the run inside the block cannot be a record (``None``: it can)."""
        watch, kind = self._watch, type(self._model).__name__
        failed = _failed(watch, spool)
        if failed is not None:
            return (
                f"{failed}, and the block went on (the exception caught inside it), so the "
                "record would hold part of the run as if it were whole; let the exception leave "
                "the block, or record a run that completes"
            )
        if watch.foreign and not hooks.entries:
            return (
                f"the model ({kind}) ran in another thread ({some_names(sorted(watch.foreign))}) "
                "than the one that entered hs.record, whose hooks act on their own thread only; "
                "enter hs.record in the thread that runs the model"
            )
        if watch.foreign_grad and any(p.grad is not None for p in self._model.parameters()):
            return (
                f"the model ({kind}) also ran in another thread "
                f"({some_names(sorted(watch.foreign))}) during the block: the parameters' .grad, "
                "shared by every thread, would mix that run's gradients with this one's; record "
                "while no other thread runs the model (or record each thread's own copy)"
            )
        if not hooks.entries:
            return (
                f"no call of the model ({kind}) or of its recorded layers ran inside the with "
                "block; run its forward (and backward) inside `with hs.record(model, folder):`"
            )
        if hooks.model_calls > 1:
            return (
                f"the model ({kind}) ran {hooks.model_calls} times inside the block; a record "
                "holds one forward and its backward: record each forward in a `with "
                "hs.record(...)` block (and folder) of its own"
            )
        if watch.drew:
            return (
                f"the model ({kind}) drew random numbers in its forward (dropout in training mode, "
                "functional dropout, torch.rand), so its values cannot be compared with another "
                "run's; call model.eval() (modules in training mode: "
                f"{', '.join(training_modules(self._model)) or 'none'}) or remove the draws"
            )
        if spool.again:
            key = spool.again[0]
            return (
                f"{_describe(key)} was written twice: the block ran more than one backward "
                "(backward(retain_graph=True) and another, or torch.autograd.grad besides "
                "backward); a record holds one forward and its one backward: record each in a "
                "`with hs.record(...)` block of its own"
            )
        changed = watch.changed()
        if changed:
            return (
                f"the gradients of {some_names(changed)} were changed inside the with block after "
                "backward made them (optimizer.zero_grad, clip_grad_norm_, a scaler's unscale_); "
                "the record would hold those, not the backward's: end the with block right after "
                "backward, before changing .grad"
            )
        return None


def _remove(paths: tuple[Path, ...]) -> list[str]:
    """Delete these files of a record that was not kept; the names of those still there (an
    unwritable folder)."""
    left = []
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            left.append(path.name)
    return left


def _failed(watch: _Watch, spool: Spool) -> str | None:
    """What failed inside the block while the block itself went on: a value that could not be
    written, the model's call that raised (or never ended), a backward that raised."""
    if spool.failed is not None:
        key, exc = spool.failed
        return (
            f"writing {_describe(key)} to {SPOOL} failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''})"
        )
    if watch.raised is not None:
        return f"the model's call raised {watch.raised}"
    if watch.depth:
        return "the model's call never ended (an exception such as KeyboardInterrupt left it)"
    if watch.outside is not None and watch.outside.failed is not None:
        return f"the backward raised {watch.outside.failed}"
    return None


# the calls that start a backward: the loss's graph is walked first (see _Outside._walk)
_BACKWARDS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


class _Outside(TorchFunctionMode):
    """Inside the record's block but outside the model's call (the watch pops it while the model
    runs): notes the model's parameters that torch functions use with gradients on, such as a
    loss term on the weights (``loss + wd * sum(p.pow(2).sum() ...)``). Their ``.grad`` then
    holds that use besides the model's: compared with a live model's, it would read as a
    fault of each module owning one."""

    def __init__(self, params: dict[int, tuple[str, torch.Tensor]], scope_id: int) -> None:
        super().__init__()
        self.params = params
        self.scope_id = scope_id  # the record's scope (see quiet)
        self.used: set[str] = set()
        self.ends: set[Any] = set()  # the autograd nodes of the model's outputs
        self.handed: dict[Any, int] = {}  # those of the values calls handed on -> the call
        self.inside: set[int] = set()  # the calls whose values the loss used, not the model's
        self.failed: str | None = None  # the exception a backward raised (its name)

    def watch(self, params: Any) -> None:
        """Also note uses of these ``(name, parameter)`` (the ones the model holds after its
        call, where a wrapper swapped them)."""
        for name, p in params:
            if p.requires_grad:
                self.params.setdefault(id(p), (name, p))

    def model_output(self, output: Any) -> None:
        """The autograd nodes of what the model's call returned: where the walk of
        :meth:`_walk` stops (the model's own graph is behind them)."""
        for t in tensors_of(output):
            if t.grad_fn is not None:
                self.ends.add(t.grad_fn)

    def _walk(self, roots: Any) -> None:
        """The parameters a backward from ``roots`` reaches without passing through the model's
        output or a value a module call handed on (whose gradients the record takes, so the
        replays count that use): used outside the model's calls, in ways no torch function shows
        (a custom autograd Function, FSDP2's ``full_tensor()``, whose forward runs with
        gradients off)."""
        stack = [t.grad_fn for t in tensors_of(roots) if t.grad_fn is not None]
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in self.ends:
                continue
            seen.add(node)
            pos = self.handed.get(node)
            if pos is not None:  # a value a call handed on inside the model, used by the loss
                self.inside.add(pos)
                continue
            var = getattr(node, "variable", None)  # an AccumulateGrad: its leaf
            if var is not None:
                hit = self.params.get(id(var))
                if hit is not None and hit[1] is var:
                    self.used.add(hit[0])
            stack.extend(n for n, _ in node.next_functions)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if quiet(self.scope_id):  # a product's own run of the model inside the block
            return func(*args, **kwargs)
        if func in _BACKWARDS:  # (its arguments are roots and inputs, not uses)
            self._walk((args, kwargs))
            try:
                return func(*args, **kwargs)
            except BaseException as exc:  # its gradients are part of the run's only
                self.failed = self.failed or type(exc).__name__
                raise
        if torch.is_grad_enabled():
            for a in (*args, *kwargs.values()):
                for x in a if a.__class__ in (list, tuple) else (a,):
                    hit = self.params.get(id(x))
                    if hit is not None and hit[1] is x:
                        self.used.add(hit[0])
        return func(*args, **kwargs)


class _Watch:
    """What the record checks of the run besides the values: the model's own calls (random
    draws between its start and end, the autocast dtype it ran under, calls from other threads)
    and each parameter's gradient as backward left it (changed later inside the block?)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.depth = 0
        self.states: GeneratorStates | None = None  # taken when the model's call started
        self.drew = False
        self.autocast: torch.dtype | None = None
        self.foreign: set[str] = set()
        self.foreign_grad = False  # one of those calls ran with gradients on
        # the exception the caller was handling when the model's call started (``None``: none),
        # and the name of one the call raised (its caller caught it inside the block)
        self.handling: BaseException | None = None
        self.raised: str | None = None
        self.order: list[str] = []  # the parameters' names, in the model's order
        # parameter name -> (its parameter, a weak reference to its .grad, that grad's _version)
        self.grads: dict[str, tuple[torch.Tensor, Any, int]] = {}
        self.generators: list[torch.Generator] = []  # the model's own (a module's self.gen)
        self.outside: _Outside | None = None  # on the torch function mode stack, but in calls
        self.popped = False
        self.model: nn.Module | None = None
        self.params0: list[tuple[str, torch.Tensor]] = []  # the model's when the block began
        # each of those parameters' _version when the model's call ended (its values then)
        self.versions: list[tuple[str, torch.Tensor, int]] | None = None

    def place(self, scope: HookScope, model: nn.Module, world: int) -> None:
        self.model = model
        self.params0 = list(named_parameters(model))
        self.generators = generators_of(model)
        # first and last of the model's hooks: a wrapper's own hooks (FSDP's unshard) are inside
        scope.add_forward_pre(model, _RootPre(self), layer="", with_kwargs=True, prepend=True)
        scope.add_forward(model, _RootPost(self), layer="", always_call=True)
        # FSDP2's sharded parameters: the model's calls use the unsharded ones (their gradients
        # reduce-scattered and set as .grad by FSDP2, not through autograd), so a gradient that
        # autograd brings to a sharded parameter itself comes from a use outside its module's
        # calls (``p.full_tensor()`` in a loss term: torch functions see no parameter there,
        # the gather reads it inside an autograd Function, with gradients off)
        for name, p in _fsdp_sharded(model):
            scope.add_tensor_hook(p, _UsedOutside(self, name), layer=name)
        if world > 1:  # DDP and FSDP2 rewrite the gradients after accumulating them: as meant
            return
        for name, p in named_parameters(model):
            if p.requires_grad and p.is_leaf:
                self.order.append(name)
                scope.add_post_accumulate_grad(p, _Accumulated(self, name), layer=name)

    def start(self, inputs: Any) -> None:
        if self.depth == 0:
            mode, n = self.outside, torch._C._len_torch_function_stack()
            if mode is not None and n and torch._C._get_function_stack_at(n - 1) is mode:
                torch._C._pop_torch_function_stack()  # the model's own uses are its own
                self.popped = True
            self.states = GeneratorStates(self.generators + generators_of(inputs))
            dev = self.device_type
            if torch.is_autocast_enabled(dev):
                self.autocast = torch.get_autocast_dtype(dev)
        self.depth += 1

    def end(self, output: Any = None) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and self.outside is not None and self.model is not None:
            # the parameters the model holds now: FSDP2 without resharding after forward
            # leaves its unsharded ones in place until the backward, and a loss term reads those
            self.outside.watch(named_parameters(self.model))
            self.outside.model_output(output)
        if self.depth == 0 and self.versions is None:
            self.versions = [(n, p, v) for n, p in self.params0 if (v := version_of(p)) is not None]
        if self.depth == 0 and self.popped:
            torch._C._push_on_torch_function_stack(self.outside)
            self.popped = False
        if self.depth == 0 and self.states is not None:
            states, self.states = self.states, None
            if states.moved():
                self.drew = True

    def moved_sums(self) -> dict[str, int]:
        """The parameters changed in place since the model's call ended (an optimizer step),
        each with the CRC-32 of its values now (:func:`weights_crc`)."""
        out = {}
        for n, p, v in self.versions or ():
            if version_of(p) != v:
                crc = weights_crc(p)
                if crc is not None:
                    out[n] = crc
        return out

    def moved_cast_sums(self) -> dict[str, dict[str, int]]:
        """Per parameter of :meth:`moved_sums` (a floating one), the CRC-32 of its values now
        cast to each other floating dtype (:data:`CAST_DTYPES`): a copy of the stepped model
        made in another dtype (``copy.deepcopy(net).to(torch.bfloat16)``) holds exactly those."""
        out: dict[str, dict[str, int]] = {}
        for n, p, v in self.versions or ():
            if version_of(p) == v or not p.is_floating_point():
                continue
            sums = {
                _dtype_name(d): crc
                for d in CAST_DTYPES
                if d != p.dtype and (crc := weights_crc(p.detach().to(d))) is not None
            }
            if sums:
                out[n] = sums  # type: ignore[assignment]
        return out

    def changed(self) -> list[str]:
        """Parameters whose ``.grad`` is no longer the tensor backward left (or was changed in
        place since)."""
        out = []
        for name in self.order:
            got = self.grads.get(name)
            if got is None:
                continue
            p, ref, version = got
            g = p.grad
            if g is None or ref() is not g or g._version != version:
                out.append(name)
        return out


class _RootPre(_Hook):
    __slots__ = ("watch",)

    def __init__(self, watch: _Watch) -> None:
        self.fn = None  # type: ignore[assignment]
        self.watch = watch

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            self.watch.foreign.add(threading.current_thread().name)
            self.watch.foreign_grad |= torch.is_grad_enabled()
            return
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        if graph_task_id() == -1:  # not a checkpoint's recompute in backward
            if self.watch.depth == 0:
                self.watch.handling = sys.exc_info()[1]
            self.watch.start((args, kwargs))


class _RootPost(_Hook):
    __slots__ = ("watch",)

    def __init__(self, watch: _Watch) -> None:
        self.fn = None  # type: ignore[assignment]
        self.watch = watch

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            return
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        if graph_task_id() == -1:
            watch = self.watch
            if watch.depth == 1:
                # an always-call hook: run from the module's ``except`` when the call raised (the
                # exception being handled then is that one, not the caller's)
                now = sys.exc_info()[1]
                if now is not None and now is not watch.handling and watch.raised is None:
                    watch.raised = type(now).__name__
            watch.end(output)


class _UsedOutside:
    """A gradient autograd brought to an FSDP2 sharded parameter: a use outside its module's
    calls (see :meth:`_Watch.place`)."""

    __slots__ = ("name", "watch")

    def __init__(self, watch: _Watch, name: str) -> None:
        self.watch, self.name = watch, name

    def __call__(self, grad: torch.Tensor) -> None:
        if self.watch.outside is not None:
            self.watch.outside.used.add(self.name)


def _fsdp_sharded(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters of ``model`` that FSDP2 (``fully_shard``) holds sharded, by name."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (torch without FSDP2)
        return []
    sharded: set[int] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = getattr(m, "_get_fsdp_state", None)  # (FSDP2's internals: as in torch 2.4+)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        for fp in getattr(group, "fsdp_params", None) or ():
            sharded.add(id(fp.sharded_param))
    return [(n, p) for n, p in named_parameters(model) if id(p) in sharded and p.requires_grad]


class _Accumulated:
    """After a parameter's gradient was accumulated: note the tensor backward left in ``.grad``."""

    __slots__ = ("name", "watch")

    def __init__(self, watch: _Watch, name: str) -> None:
        self.watch, self.name = watch, name

    def __call__(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None:
            self.watch.grads[self.name] = (p, weakref.ref(g), g._version)


# the dtypes a copy of a model is commonly made in, for the checksums of stepped parameters
CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def weights_crc(t: torch.Tensor) -> int | None:
    """CRC-32 of a plain tensor's values with its dtype and shape (``None`` for a tensor of
    another kind: a sharded DTensor)."""
    data = _raw(t.detach()) if t.__class__ in (torch.Tensor, nn.Parameter) else None
    if data is None:
        return None
    return zlib.crc32(data, zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode()))


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _detached(t: torch.Tensor) -> torch.Tensor:
    # the spool writes its bytes at once (no copy needed), and finds a tensor it wrote already
    # by the memory it views while that tensor lives: the tensor itself, not a detached alias
    return t


def unwrapped(model: Any) -> Any:
    """The model a ``DistributedDataParallel`` or ``nn.DataParallel`` wraps (its ``.module``:
    the eager names, without the wrapper's ``module.`` prefix); anything else as it is."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _rank_world() -> tuple[int, int]:
    """This process's rank and the world size of an initialised ``torch.distributed`` run."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_RECORDS = itertools.count()  # the records this process made under torch.distributed


def _run_id() -> str | None:
    """An id every rank's record of one run shares, and no other run's: the first rank to
    start its ``k``-th record sets a new one in the process group's store (set-if-absent), the
    others read it (no collective: a rank that records alone does not wait for the others).
    ``None`` where the store cannot be reached (the rank hosting it has ended the process group:
    a forward-only last step, no collective after it); the check of run ids then skips it."""
    k = next(_RECORDS)
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        got = store.compare_set(f"hookscope/record/{k}", "", uuid.uuid4().hex)
    except Exception:  # (a backend without a store of this kind)
        return None
    return got.decode() if isinstance(got, bytes) else str(got)


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter gradient on the CPU, whole: a sharded one (FSDP2 ``DTensor``) is gathered
    (a collective: every rank calls this for the same parameters in the same order)."""
    if g is None:
        return None
    full = getattr(g, "full_tensor", None)
    return cpu_copy(full() if full is not None else g)


def record(model: nn.Module, folder: str | os.PathLike[str], layers: Any = None) -> Record:
    """Write what :func:`hookscope.compare` needs of one run to ``folder``, as the run goes.

    Use it around one forward (and backward) of the run to keep; compare it later, in another
    process or on another machine, with ``hs.compare(folder, live_model, *inputs, loss_fn=...)``
    (the same culprit semantics as two live models) or ``hs.compare(folder_a, folder_b)``
    (errors and ``first_divergent``; the culprit needs a live B). Each module call's inputs,
    output and gradients are written when they exist (nothing is kept in memory); the files are
    pickles: load only records you trust.

    In a ``torch.distributed`` run (a ``DistributedDataParallel`` model, or one sharded with
    FSDP2 ``fully_shard``), every rank records into its own subfolder ``rank<r>`` of ``folder``
    (the world size in each ``index.json``), with the wrapped model's names (no ``module.``
    prefix) and the parameter gradients as the ranks share them (averaged, gathered whole);
    ``hs.compare(folder, b, *combined_inputs, ...)`` joins the ranks' values along the batch
    dimension and compares them with one process on the combined batch (see
    :func:`hookscope.compare`, ``loss_reduction``).

    Args:
        model: the model to record (compiled models get their eager names).
        folder: an empty or new folder.
        layers: record only these modules (a selector, see :func:`hookscope.find`); the calls a
            recorded module makes to unrecorded ones then run for real in the replay, so its
            local error covers them too.

    Example:
        >>> import copy, tempfile, torch, torch.nn as nn, hookscope as hs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(3, 4)
        >>> folder = tempfile.mkdtemp()
        >>> with hs.record(net, folder):
        ...     net(x).sum().backward()
        >>> net.zero_grad(set_to_none=True)
        >>> other = copy.deepcopy(net)
        >>> other[2].bias.data += 0.1
        >>> hs.compare(folder, other, x, loss_fn=lambda o: o.sum()).culprit
        '2'
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"hs.record: folder must be a str or os.PathLike (a new or empty folder), "
            f"got {type(folder).__name__}"
        )
    if Path(folder).exists() and not Path(folder).is_dir():
        raise CompareError(
            f"hs.record: {str(folder)!r} is not a folder (a file is there); give a new or empty "
            "folder"
        )
    return Record(model, Path(folder), layers)


def load_record(folder: str | os.PathLike[str], loss_reduction: str = "mean") -> RunRecord:
    """A folder written by :func:`record`, as a run whose values are read from disk on use; a
    folder written by several ranks is one run on the combined batch (:func:`join_ranks`)."""
    if loss_reduction not in REDUCTIONS:
        raise CompareError(
            f"hs.compare: loss_reduction={loss_reduction!r} is not one of "
            f"{', '.join(map(repr, REDUCTIONS))} (how the loss of each rank reduced its share of "
            "the batch, for a record made on several ranks)"
        )
    path = Path(folder)
    if of_ranks(path):
        return _load_ranks(path, loss_reduction)
    return _load_one(path)


_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _check_index(index: dict[str, Any], path: Path) -> None:
    """An index.json as :class:`Record` writes it, else :class:`CompareError` naming what is
    wrong (a hand edit, a merge, a copy cut short): its fields and types, its calls one tree (a
    call's parent started before it and lists it as a child), and, for the current format, the
    values of every call present."""

    def damaged(why: str) -> CompareError:
        return CompareError(
            f"hs.compare: the record {str(path)!r} is damaged: its index.json {why}; copy it "
            "again whole, or record again"
        )

    version = index.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise damaged(f'has "version" {version!r}, not a number')
    if version > _VERSION:  # a later format: its fields may mean other things than these
        raise CompareError(
            f"hs.compare: the record {str(path)!r} was written by a newer hookscope (record "
            f"format {version}; this hookscope {__version__} reads formats 1 to {_VERSION}); "
            "upgrade hookscope to read it"
        )
    if version < 1:
        raise damaged(f'has "version" {version!r} (formats start at 1)')
    if index.get("dtype") not in _DTYPES:
        raise damaged(f'has "dtype" {index.get("dtype")!r}, not one of {", ".join(_DTYPES)}')
    if index.get("autocast") not in (None, *_DTYPES):
        raise damaged(f'has "autocast" {index.get("autocast")!r}')
    if not isinstance(index.get("grads"), bool):
        raise damaged('has no "grads" (true or false)')
    if not isinstance(index.get("params"), dict):
        raise damaged('has no "params" (the module of each parameter)')
    for field in ("lost", "elsewhere", "checksums", "modes"):
        if not isinstance(index.get(field, {}), dict):
            raise damaged(f'has a "{field}" that is not an object')
    calls = index["calls"]
    n = len(calls)
    fields = {"name": str, "index": int, "end": int, "n_in": int, "n_out": int, "children": list}
    for pos, e in enumerate(calls):
        if not isinstance(e, dict) or any(not isinstance(e.get(k), t) for k, t in fields.items()):
            raise damaged(f"has call {pos} without its fields ({', '.join(fields)}, parent)")
        parent = e.get("parent")
        if parent is not None and (
            not isinstance(parent, int)
            or not 0 <= parent < pos
            or pos not in calls[parent]["children"]
        ):
            raise damaged(
                f"has call {pos} ({e['name'] or '<root>'}) whose parent is not a call before it"
            )
        if any(not isinstance(c, int) or not pos < c < n for c in e["children"]):
            raise damaged(
                f"has call {pos} ({e['name'] or '<root>'}) listing children it does not hold"
            )
    if version >= 2:
        values = index.get("values")
        if not isinstance(values, dict):
            raise damaged('has no "values" (where each value lies in values.bin)')
        for pos, e in enumerate(calls):
            for kind, count in (("in", e["n_in"]), ("out", e["n_out"])):
                if count and f"{kind}{pos}" not in values:
                    raise damaged(f"has no {_describe(f'{kind}{pos}')} ({e['name'] or '<root>'})")


def _rank_indexes(path: Path) -> list[Path]:
    return sorted(
        (p for p in path.glob("rank*/index.json") if p.parent.name[4:].isdigit()),
        key=lambda p: int(p.parent.name[4:]),
    )


def _index_crc(index: dict[str, Any]) -> int:
    """CRC-32 of an index as JSON read it (keys sorted), without its own checksum."""
    sums = {k: v for k, v in (index.get("checksums") or {}).items() if k != "index.json"}
    body = {**index, "checksums": sums}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def of_ranks(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a record made on several ranks (``rank<r>`` subfolders; a folder
    holding both kinds of record is refused)."""
    path = Path(folder)
    ranks = _rank_indexes(path) if path.is_dir() else []
    if ranks and (path / "index.json").exists():
        raise CompareError(
            f"hs.compare: {str(path)!r} holds both a record of one process (index.json) and "
            f"records of ranks ({', '.join(p.parent.name for p in ranks[:3])}): two runs were "
            "recorded into one folder; give each record a folder of its own"
        )
    return bool(ranks)


def _load_ranks(path: Path, loss_reduction: str) -> RunRecord:
    indexes = _rank_indexes(path)
    try:
        world = json.loads(indexes[0].read_text()).get("world", 1)
    except (ValueError, AttributeError):
        world = None
    if not isinstance(world, int) or world < 2:
        raise CompareError(
            f"hs.compare: the record {str(indexes[0].parent)!r} is damaged: its index.json has no "
            "number of ranks; copy it again whole, or record again"
        )
    missing = [r for r in range(world) if not (path / f"rank{r}" / "index.json").exists()]
    if missing:
        raise CompareError(
            f"hs.compare: {str(path)!r} was recorded on {world} ranks but holds no record of "
            f"rank(s) {missing}; wait for every rank to leave `hs.record`, or record again"
        )
    extra = [p.parent.name for p in indexes if int(p.parent.name[4:]) >= world]
    recs = []
    runs: list[str | None] = []  # the run id of each rank's record (None: an older record)
    for r in range(world):
        folder = path / f"rank{r}"
        index = _read_index(folder)
        if (index.get("rank"), index.get("world")) != (r, world) or extra:
            got = f"rank {index.get('rank')} of {index.get('world')}"
            raise CompareError(
                f"hs.compare: {str(path)!r} does not hold the records of the {world} ranks of "
                "one run: "
                + (f"it also holds {', '.join(extra)}" if extra else f"{folder.name} holds {got}")
                + "; record every rank of one run into an empty folder (rank folders copied "
                "from several runs are not one run)"
            )
        runs.append(index.get("run"))
        recs.append(_load_one(folder))
    known = [(r, run) for r, run in enumerate(runs) if run is not None]
    other = next((r for r, run in known if run != known[0][1]), None)
    if other is not None:
        raise CompareError(
            f"hs.compare: the rank records in {str(path)!r} come from different runs "
            f"(rank{known[0][0]}'s and rank{other}'s were made in other runs of the ranks); "
            "record every rank of one run into an empty folder"
        )
    _check_one_run(path, recs)
    return join_ranks(recs, loss_reduction)


def _check_one_run(path: Path, recs: list[RunRecord]) -> None:
    """The ranks' records come from one run: DDP and FSDP2 leave every rank the same parameter
    gradients (the record writes each one whole), so a rank folder from another run (another
    batch, another model) shows as a gradient that differs."""
    base = recs[0].param_grads
    for r, rec in enumerate(recs[1:], 1):
        for name, g in base.items():
            h = rec.param_grads.get(name)
            if g is None or h is None:
                continue
            if g.shape != h.shape or not torch.equal(g, h):
                raise CompareError(
                    f"hs.compare: the rank records in {str(path)!r} cannot be one run on the "
                    f"combined batch: the gradient of {name!r} differs between rank0 and rank{r} "
                    "(DDP and FSDP2 give every rank the same, reduced one). Either the backward "
                    "did not reduce them (DDP's no_sync(), gradient accumulation: record a step "
                    "whose backward syncs), or the rank folders come from different runs (record "
                    "every rank of one run into an empty folder)"
                )


def _read_index(path: Path) -> dict[str, Any]:
    """The index.json of the record in ``path`` (a JSON object holding ``calls`` and ``model``),
    else :class:`CompareError` naming the folder."""
    index_path = path / "index.json"
    if not index_path.exists():
        raise CompareError(
            f"hs.compare: {str(path)!r} is not a record (no index.json): write one with "
            "`with hs.record(model, folder): ...`"
        )
    try:
        index = json.loads(index_path.read_text())
        _ = list(index["calls"]), index["model"]  # (present, of these kinds)
    except (ValueError, KeyError, TypeError) as exc:
        raise CompareError(
            f"hs.compare: {str(path)!r} is not a record written by hs.record (its index.json "
            f"cannot be read: {type(exc).__name__}); write one with `with hs.record(model, "
            "folder): ...`"
        ) from None
    return index  # type: ignore[no-any-return]


def _load_one(path: Path) -> RunRecord:
    index = _read_index(path)
    entries, model = list(index["calls"]), index["model"]
    _check_index(index, path)
    want = (index.get("checksums") or {}).get("index.json")
    if want is not None and want != _index_crc(index):
        raise CompareError(
            f"hs.compare: the record {str(path)!r} is damaged: its index.json was changed after "
            "the record wrote it (its checksum differs); copy the record again whole, or record "
            "again"
        )
    n = index.get("model_calls", sum(1 for e in entries if e["name"] == ""))
    if n > 1:
        raise CompareError(
            f"hs.compare: the record {str(path)!r} holds {n} calls of the model ({model}); "
            "hs.compare compares one forward (and its backward): record each forward in a "
            "folder of its own (`with hs.record(model, folder): ...` around one call)"
        )
    if index.get("version", 1) >= 2:
        try:
            store: Any = SpoolReader(path / SPOOL, index.get("values", {}))
        except (ValueError, TypeError, IndexError, AttributeError):
            raise CompareError(
                f'hs.compare: the record {str(path)!r} is damaged: the "values" of its '
                "index.json are not (offset, length) pairs; copy it again whole, or record again"
            ) from None
        # every value inside values.bin (a file cut short is refused here), and the file the one
        # written with this index (a changed byte, another record's file)
        store.check(index.get("checksums", {}).get(SPOOL))
    else:
        store = ValueStore(0, path)  # format 1: one torch.save file per value
    calls = calls_of(entries, store)
    try:
        blob = (path / "params.pt").read_bytes()
        want = index.get("checksums", {}).get("params.pt")
        if want is not None and [zlib.crc32(blob), len(blob)] != list(want):
            raise CompareError(
                f"hs.compare: the record {str(path)!r} is damaged: params.pt is not the file "
                "written with its index.json (its checksum differs: changed since, or the file "
                "of another record); copy it again whole, or record again"
            )
        params = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    except CompareError:
        raise
    except Exception as exc:  # missing, cut short: the parameter gradients cannot be read
        raise CompareError(
            f"hs.compare: the record {str(path)!r} is damaged: its params.pt (the parameter "
            f"gradients) cannot be read ({type(exc).__name__}); copy it again whole, or record "
            "again"
        ) from None
    return RunRecord(
        model=str(model),
        calls=calls,
        by_key={c.key: i for i, c in enumerate(calls)},
        param_grads=params,
        dtype=getattr(torch, index["dtype"]),
        autocast=getattr(torch, index["autocast"]) if index.get("autocast") else None,
        has_grads=bool(index["grads"]),
        params=index["params"],
        partial_grads=index.get("version", 1) < 2 or bool(index.get("lost")),
        lost=dict(index.get("lost") or {}),
        elsewhere=dict(index.get("elsewhere") or {}),
        modes=index.get("modes"),
        outside=set(index.get("outside") or ()),
        loss_inside=set(index.get("loss_inside") or ()),
        moved=dict(index.get("moved") or {}),
        moved_cast={k: dict(v) for k, v in (index.get("moved_cast") or {}).items()},
        quantized=str(index.get("quantized") or ""),
    )
