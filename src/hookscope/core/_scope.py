"""The hook engine: every hook hookscope adds is owned by a :class:`HookScope`.

A scope registers hooks through PyTorch's public API, keeps their handles, and removes them all
on :meth:`HookScope.remove` (idempotent), on ``with`` exit, on an exception and on
``KeyboardInterrupt``. Nested scopes remove only their own hooks. The callable placed in PyTorch's
hook dicts is a :class:`_Hook`, which marks the hook as hookscope's (so :func:`hooks_on` can tell
them apart and :func:`remove_hooks` removes only ours), never holds the module (so the model is
freed by reference counting alone) and turns into an inert no-op when the model is deep-copied or
pickled (so ``copy.deepcopy(model)`` does not write into the original's store and
``torch.save(model)`` works while hooks are attached).

A scope told where its hooks sit (:meth:`HookScope.track`) says, at a read and once at removal,
when the model holds another module at a layer's name (``model.fc = nn.Linear(...)`` while it is
open: the new module runs without its hooks); :func:`remove_hooks` marks the open scopes whose
hooks it takes (:func:`note_stripped`); :func:`warn_lost` is the warning the scopes give at exit.

Threads: a scope acts only on the calls made by the thread that created it (see
:func:`acts_here`): another thread calling the same model meanwhile runs it as if the scope were
not there, so two threads capturing, editing or steering one model never see each other's calls.
The worker threads of ``nn.DataParallel`` (``parallel_apply``) count as the thread whose call
started them, and autograd's own threads (a CUDA backward re-running forward for activation
checkpointing) as every thread's: PyTorch does not say which thread's backward they run.
Gradient hooks on tensors (parameters, activations) are not filtered: an activation's hooks are
attached by its own thread's forward, and a parameter is shared by every thread that trains it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ._compiled import (
    check_not_in_compiled_forward,
    compiled_regions,
    generate_guard,
    index_generate,
    is_optimized,
    named_modules,
    named_parameters,
    region_of,
    routing,
    strip_compiled,
    unrouted_wrapper,
)
from ._errors import (
    HookConflictError,
    HookscopeWarning,
    UnsupportedModelError,
    enter_once,
    some_names,
)
from ._nested import describe_call, map_tensors

__all__ = [
    "HookScope",
    "acts_here",
    "ancestors",
    "attribute_path",
    "check_model",
    "get_ident",
    "graph_task_id",
    "in_backward",
    "internal_run",
    "locate_errors",
    "lost_layers",
    "note_exception",
    "note_stripped",
    "quiet",
    "ran_in_copy",
    "stale_names",
    "thread_checked",
    "warn_elsewhere",
    "warn_lost",
]

_scope_ids = itertools.count(1)
get_ident: Callable[[], int] = threading.get_ident
"""The calling thread's id (a C function: what a hot hook compares with its ``thread``)."""

_verdicts = threading.local()  # per thread: {opening thread id: whether this thread acts for it}

# owners of the scopes that watch a model's runs (they keep or count what runs through it):
# a product's own runs of the model (internal_run) are not theirs
WATCHING = frozenset(
    {
        "capture",
        "monitor",
        "monitor.sentinel",
        "record",
        "observe",
        "tensor_grads",
        "memory_profile",
        "trace",
    }
)
_LIVE: weakref.WeakSet[HookScope] = weakref.WeakSet()  # every scope made (those active: watched)


class _Quiet(threading.local):
    ids: frozenset[int] = frozenset()  # this thread's: the watching scopes sitting its run out


_QUIET = _Quiet()
_RUNS = [0]  # internal runs under way, in any thread (the hooks' fast check)
_RUNS_LOCK = threading.Lock()


def quiet(scope_id: int) -> bool:
    """Whether a hook of scope ``scope_id`` sits this call out: the scope watches the model (a
    capture, a monitor, a record) and this thread is in a product's own run of it
    (:func:`internal_run`). One list read when no such run is under way."""
    return bool(_RUNS[0]) and scope_id in _QUIET.ids


@contextlib.contextmanager
def internal_run() -> Iterator[None]:
    """A product running the model for its own work (``hs.compare``'s runs and replays, a
    summary's forward, a CAM's, ``find_nonfinite``'s, a patching sweep's, ``steering_vector``'s,
    ``extract``'s, ``memory_profile``'s step; each enters it in its own body): the watching scopes active now
    (:data:`WATCHING`) do not see it, in this thread, until it ends. A capture or a monitor open around
    ``hs.compare(model, ...)`` kept compare's runs as the model's own (a monitor's step
    statistics were those of compare's inputs; ``cap[name]`` its last run's output)."""
    before = _QUIET.ids
    with _RUNS_LOCK:
        mine = {s.id for s in list(_LIVE) if s.active and s.owner in WATCHING}
    _QUIET.ids = before | frozenset(mine)
    with _RUNS_LOCK:
        _RUNS[0] += 1
    try:
        yield
    finally:
        with _RUNS_LOCK:
            _RUNS[0] -= 1
        _QUIET.ids = before


def _parallel_apply_frame(frame: Any) -> Any:
    """The frame of ``torch.nn.parallel.parallel_apply`` (or its ``_worker``) on a stack, if any."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("parallel_apply.py") and code.co_name in (
            "parallel_apply",
            "_worker",
        ):
            return frame
        frame = frame.f_back
    return None


def _worker_of(thread: int) -> bool:
    """Whether this thread is a ``parallel_apply`` worker (``nn.DataParallel``'s replica threads)
    running one of the modules that ``thread`` passed to its ``parallel_apply`` call now."""
    mine = _parallel_apply_frame(sys._getframe(1))
    if mine is None or mine.f_code.co_name != "_worker":
        return False
    theirs = _parallel_apply_frame(sys._current_frames().get(thread))
    if theirs is None:
        return False
    module = mine.f_locals.get("module")
    return any(m is module for m in theirs.f_locals.get("modules") or ())


_GRAD_KINDS = frozenset(("tensor", "post_accumulate_grad"))


def acts_here(thread: int, kind: str = "forward", hook: Any = None, module: Any = None) -> bool:
    """For a hook of a scope opened by ``thread``, called from another thread: whether it acts.

    A gradient hook on a tensor (``kind`` ``"tensor"`` or ``"post_accumulate_grad"``) always does.
    A module hook does in ``nn.DataParallel``'s worker threads started by ``thread``'s call, and in
    autograd's own threads during a backward pass (a recompute for activation checkpointing on
    CUDA); in any other thread it does nothing. Only called off the opening thread (the fast path compares
    :func:`get_ident` with the hook's ``thread``). The verdict is kept per thread. ``hook`` (a
    :class:`_Hook`) and ``module`` (the module called): where it does nothing and the call is
    part of a call of ``thread``'s (a worker thread the model's forward started and waits on:
    see :func:`_waits_on`), the hook's scope notes the layer and the thread
    (:attr:`HookScope.elsewhere`), so that what the scope reports can say what it left out.
    """
    if kind in _GRAD_KINDS:
        return True
    verdicts = _verdicts.__dict__.setdefault("of", {})
    verdict = verdicts.get(thread)
    if verdict is None:
        verdict = verdicts[thread] = _worker_of(thread)
    if verdict:
        return True
    # a thread Python did not start (autograd's device threads) shows as a "dummy" thread
    if in_backward() and type(threading.current_thread()).__name__ == "_DummyThread":
        return True
    if hook is not None:
        _note_elsewhere(hook, thread, module)
    return False


_WAITS = ("threading.py", "queue.py", "_base.py", "thread.py", "process.py")


def _waits_on(thread: int, module: Any) -> bool:
    """Whether ``thread`` now waits (a thread's ``join``, a queue, a future's ``result``) inside a
    call of a module holding ``module`` (any module when ``None``): this thread's call of
    ``module`` is then part of that call, a worker the model's forward started (not another
    thread running the model by itself, whose calls are its own)."""
    frame = sys._current_frames().get(thread)
    depth = 0
    while frame is not None and depth < 12:  # the innermost frames: a wait of the standard library
        code = frame.f_code
        if code.co_filename.endswith(_WAITS) and (
            "threading" in code.co_filename
            or "queue" in code.co_filename
            or "concurrent" in code.co_filename
        ):
            break
        frame, depth = frame.f_back, depth + 1
    else:
        return False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_call_impl" and code.co_filename.endswith("module.py"):
            outer = frame.f_locals.get("self")
            if isinstance(outer, nn.Module) and (
                module is None or any(m is module for m in outer.modules())
            ):
                return True
        frame = frame.f_back
    return False


def _note_elsewhere(hook: Any, thread: int, module: Any) -> None:
    """A module hook of ``hook``'s scope was called from a thread it does not act on: where the
    call is part of a call of the scope's thread (:func:`_waits_on`), the scope notes the layer
    and the thread's name (the first one met)."""
    sid, layer = getattr(hook, "scope_id", None), getattr(hook, "layer", None)
    if sid is None or layer is None or not _waits_on(thread, module):
        return
    name = threading.current_thread().name
    with _RUNS_LOCK:
        scopes = [s for s in list(_LIVE) if s.id == sid and s.active]
    for s in scopes:
        if layer not in s.elsewhere:
            s.elsewhere[layer] = name


class _InertHook:
    """What a hookscope hook becomes in a deep copy or a pickle: does nothing, returns None.

    A deep copy's inert hook keeps its scope's id and notes, on its first call, that a copy ran
    the layer (:func:`ran_in_copy`), so a scope whose layer never ran can say that a copy did;
    one made by unpickling has no scope (ids are this process's).
    """

    __slots__ = ("kind", "layer", "owner", "scope_id")

    def __init__(self, owner: str, kind: str, layer: str, scope_id: int | None = None) -> None:
        self.owner, self.kind, self.layer, self.scope_id = owner, kind, layer, scope_id

    def __call__(self, *args: Any) -> None:
        sid = self.scope_id
        if sid is not None and not torch.compiler.is_compiling():
            self.scope_id = None  # (noted once per hook: the scopes are looked up once)
            with _RUNS_LOCK:
                scopes = [s for s in list(_LIVE) if s.id == sid and s.active]
            for s in scopes:
                s.copy_ran.add(self.layer)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook(self.owner, self.kind, self.layer, self.scope_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_InertHook, (self.owner, self.kind, self.layer))

    def __repr__(self) -> str:
        return f"<inert hookscope {self.kind} hook of {self.owner} on {self.layer!r}>"


def ran_in_copy(scope: HookScope, layer: str) -> bool:
    """Whether a deep copy of the model (made while ``scope`` held its hooks: the copy's hooks
    are inert) called ``layer`` while ``scope`` was active: what a layer that "never ran" in
    the model may have done in a copy."""
    return layer in scope.copy_ran


class _Hook:
    """The callable hookscope registers with PyTorch. Holds the function, not the module.

    Hot paths subclass it and override ``__call__`` to skip the indirection through ``fn``. A
    subclass's ``__call__`` is wrapped so that it runs only for the scope's own thread (see
    :func:`acts_here`), unless it is marked ``thread_checked`` (it makes the check itself, inline:
    ``if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
    return None``).
    """

    __slots__ = ("fn", "kind", "layer", "owner", "scope_id", "thread")

    def __init__(
        self, fn: Callable[..., Any], owner: str, kind: str, layer: str, scope_id: int
    ) -> None:
        self.fn, self.owner, self.kind, self.layer, self.scope_id = fn, owner, kind, layer, scope_id
        self.thread = get_ident()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "thread_checked", False):
            cls.__call__ = _thread_checked(call)  # type: ignore[method-assign]

    def __call__(self, *args: Any) -> Any:
        if get_ident() != self.thread and not acts_here(
            self.thread, self.kind, self, args[0] if args else None
        ):
            return None
        if _RUNS[0] and self.scope_id in _QUIET.ids:
            return None
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook(self.owner, self.kind, self.layer, self.scope_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_InertHook, (self.owner, self.kind, self.layer))

    def __repr__(self) -> str:
        return f"<hookscope {self.kind} hook of {self.owner} on {self.layer!r}>"


def _thread_checked(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` of a :class:`_Hook` subclass, run only for its scope's thread (:func:`acts_here`)."""

    def checked(self: _Hook, *args: Any) -> Any:
        if get_ident() != self.thread and not acts_here(
            self.thread, self.kind, self, args[0] if args else None
        ):
            return None
        if _RUNS[0] and self.scope_id in _QUIET.ids:
            return None
        return call(self, *args)

    checked.thread_checked = True  # type: ignore[attr-defined]
    checked.__doc__ = call.__doc__
    return checked


def thread_checked(call: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hot ``__call__`` that checks the thread itself (see :class:`_Hook`)."""
    call.thread_checked = True  # type: ignore[attr-defined]
    return call


class _GradHook(_Hook):
    """A gradient hook on a tensor: runs in whatever thread autograd runs it (not filtered).

    A compiled graph (``torch.compile``'s AOT autograd) calls the hooks of an output that got no
    gradient with ``None`` where eager autograd does not call them: such calls are skipped, so
    the hook sees what it sees in eager mode.
    """

    __slots__ = ()

    @thread_checked
    def __call__(self, *args: Any) -> Any:
        if args[0] is None:
            return None
        if _RUNS[0] and self.scope_id in _QUIET.ids:  # a product's own run of the model
            return None
        return self.fn(*args)


class _FirstGrad:
    """A backward node's pre-hook handing its first input gradient to ``fn``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, grads: tuple[Any, ...]) -> None:
        self.fn(grads[0])


class _OpaqueHook(_Hook):
    """A hook inside a compiled region: Dynamo breaks the graph and runs it eagerly (exact values).

    ``__call__`` is wrapped with ``torch._dynamo.disable`` on first use (see :func:`_opaque`), so
    ``import hookscope`` does not import Dynamo.
    """

    __slots__ = ("region", "release")

    def __init__(self, inner: _Hook, region: Any, release: Callable[[], None]) -> None:
        super().__init__(inner, inner.owner, inner.kind, inner.layer, inner.scope_id)
        self.region, self.release = region, release

    @thread_checked  # the inner hook checks
    def __call__(self, *args: Any) -> Any:
        self.region.fired += 1
        return self.fn(*args)


_opaque_ready: list[bool] = []


def _opaque(inner: _Hook, region: Any, release: Callable[[], None]) -> _OpaqueHook:
    if not _opaque_ready:  # once: Dynamo is loaded anyway when a model is compiled
        _opaque_ready.append(True)
        disabled = torch._dynamo.disable(_OpaqueHook.__call__, recursive=True)
        _OpaqueHook.__call__ = disabled  # type: ignore[method-assign]
    return _OpaqueHook(inner, region, release)


class _UntracedHook(_Hook):
    """A module hook outside every region hookscope routes, in a process where Dynamo compiled:
    where a compiled caller hookscope was not given traces the module's call (``cm =
    torch.compile(model)`` called, ``model`` handed to hookscope; a Trainer's own compile),
    Dynamo breaks the graph at the hook and runs it eagerly on the real tensors, instead of
    tracing hookscope's code (which it may trace wrongly: an integer it made symbolic in an
    f-string raised ``InternalTorchDynamoError``; each hooked layer recompiled the hook's resume
    code until Dynamo's recompile limit). Whether that compiled code calls the hook at all is
    Dynamo's (pytorch#117758): ``HookScope.watch_unrouted`` says when it does not.

    ``__call__`` is wrapped with ``torch._dynamo.disable`` on first use, as
    :class:`_OpaqueHook`'s."""

    __slots__ = ()

    def __init__(self, inner: _Hook) -> None:
        super().__init__(inner, inner.owner, inner.kind, inner.layer, inner.scope_id)

    @thread_checked  # the inner hook checks
    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


_untraced_ready: list[bool] = []


def _untraced(hook: _Hook) -> _Hook:
    """``hook``, made opaque to Dynamo where Dynamo has compiled a frame in this process (a
    compiled caller hookscope was not given may trace the module's calls); else ``hook`` itself:
    the wrapper costs ~1 us a call, and merely loading Dynamo (importing transformers does) must
    not cost every hook that. A hook placed before the first compile of the process is traced
    as Dynamo traces any hook (exact; see the guide)."""
    if not _dynamo_compiled():
        return hook
    if not _untraced_ready:
        _untraced_ready.append(True)
        disabled = torch._dynamo.disable(_UntracedHook.__call__, recursive=True)
        _UntracedHook.__call__ = disabled  # type: ignore[method-assign]
    return _UntracedHook(hook)


def _dynamo_compiled() -> bool:
    """Whether Dynamo compiled (or tried to compile) a frame in this process."""
    dyn = sys.modules.get("torch._dynamo.utils")
    return dyn is not None and bool(dyn.counters["frames"]["total"])


def check_model(model: nn.Module) -> None:
    """Refuse models whose hooks would fail; make hooks on compiled parts run (docs/pitfalls.md §15, §16).

    A ``torch.compile``'d model, a ``model.compile()``'d one and a model with compiled submodules
    are indexed, so that a hook a scope adds inside a compiled region makes that region's calls run
    a hooked variant of the compiled code (see :mod:`hookscope.core._compiled`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (the object you call); got {type(model).__name__}"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"{type(model).__name__} is a TorchScript module, which cannot run Python hooks; "
            "use the original nn.Module (before torch.jit.script/trace)"
        )
    compiled_regions(
        model
    )  # index its compiled parts: hooks on them get routed (docs/pitfalls.md §15)
    index_generate(model)  # generate() compiling the model by itself: run those steps eagerly


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model with neither."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def identity_views(
    args: Any, kwargs: Any, on_view: Callable[[torch.Tensor, torch.Tensor], None] | None = None
) -> tuple[Any, Any]:
    """Route each input tensor that requires grad through its own identity view.

    A gradient hook on the view sees the gradient flowing through *this* layer only (a tensor also
    used elsewhere, e.g. by a residual, gets the rest of its gradient from other paths). The same
    tensor gets the same view, so identity checks such as ``query is key`` keep their path
    (docs/pitfalls.md §4). ``on_view(view, tensor)`` is called once per new view. Returns
    ``(args, kwargs)`` for a ``with_kwargs`` forward pre-hook to return.

    A view keeps the run exact (an in-place op on it, ``nn.ReLU(inplace=True)``, updates its
    base's autograd history: later uses of the tensor get the right gradient), but PyTorch drops
    a gradient hook on a view that is changed in place: a caller checks the view's ``_version``
    after the layer ran (``on_view`` gives it the views) and says the gradient is lost. (An alias
    that is not a view keeps the hook but breaks that history: a residual kept from before an
    in-place ReLU then gets a wrong gradient; tested.)
    """
    views: dict[int, torch.Tensor] = {}

    def alias(t: torch.Tensor) -> torch.Tensor:
        if not t.requires_grad:
            return t
        v = views.get(id(t))
        if v is None:
            v = views[id(t)] = t.view_as(t)
            if on_view is not None:
                on_view(v, t)
        return v

    return map_tensors(alias, args), map_tensors(alias, kwargs)


_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
graph_task_id: Callable[[], int] = _graph_task_id if _graph_task_id is not None else (lambda: -1)
"""The running backward pass's id, -1 outside backward (a C function: cheap in hot hooks)."""


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing re-runs forward)."""
    return _graph_task_id is not None and _graph_task_id() != -1


_noted: threading.local = threading.local()


def note_exception(layer: str, module: nn.Module, args: Any, kwargs: Any = None) -> None:
    """From an ``always_call`` forward hook: if ``forward`` is raising, name the layer in the error.

    PyTorch calls ``always_call`` hooks from inside its ``except`` block, so the exception being
    raised is visible through :func:`sys.exc_info`; the innermost layer sees it first, and only that
    one adds a note (``layer 'x' (Conv2d) got input shapes ...``) to the original exception.
    """
    exc = sys.exc_info()[1]
    if exc is None or getattr(_noted, "exc", None) is exc or isinstance(exc, _StopSignal):
        return
    _noted.exc = exc
    shown = layer if layer else "<root>"
    note = f"hookscope: raised inside layer {shown!r} ({type(module).__name__}), called with input shapes {describe_call(args, kwargs)}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    try:
        exc.hookscope_layer = layer  # type: ignore[attr-defined]
        exc.hookscope_inputs = describe_call(args, kwargs)  # type: ignore[attr-defined]
    except Exception:
        pass


class _StopSignal(BaseException):
    """Raised from a hook to end a forward pass early; caught by the scope that raised it. A
    ``BaseException``: a model's own ``except Exception:`` (a fallback path) must not catch it
    and run on, handing later hooks the fallback's values."""

    def __init__(self, scope_id: int) -> None:
        super().__init__(f"hookscope early stop (scope {scope_id})")
        self.scope_id = scope_id


class HookScope:
    """Owns a set of hooks; removes them all on :meth:`remove` or at the end of a ``with`` block.

    Features (capture, edit, trace, summary, monitor, CAM) are thin clients: they create a scope
    and register through its ``add_*`` methods, which accept plain functions with PyTorch's hook
    signatures.

    A scope also knows when its hooks stopped seeing a layer's calls while it was open, so that
    a feature can say why instead of "never ran": :meth:`track` / :meth:`replaced` (the model
    holds another module at the layer's name now), :attr:`stripped` (layers whose hooks
    :func:`remove_hooks` took) and :attr:`copy_ran` (layers a deep copy of the model ran, its
    hooks inert). None of it adds work to a hook's call.

    Example:
        >>> import torch, torch.nn as nn
        >>> from hookscope import HookScope, hooks_on
        >>> net = nn.Linear(2, 2)
        >>> with HookScope("demo") as scope:
        ...     _ = scope.add_forward(net, lambda m, i, o: None, layer="")
        ...     len(hooks_on(net))
        1
        >>> len(hooks_on(net))
        0
    """

    def __init__(self, owner: str = "hookscope") -> None:
        self.owner = owner
        self.id = next(_scope_ids)
        self.active = True
        with _RUNS_LOCK:
            _LIVE.add(self)
        self.thread = get_ident()  # the thread whose calls the hooks act on (see acts_here)
        self.failed = False  # its `with` block is ending by an exception
        self._handles: list[RemovableHandle] = []
        # hooks placed by add_forward_many: (the module's hook dict, the hook's id)
        self._direct: list[tuple[dict[int, Any], int]] = []
        self._on_remove: list[Callable[[], None]] = []
        # where the hooks sit (track): the model, {name: module}, {name: parameter}, held weakly
        self._places: tuple[Any, dict[str, Any], dict[str, Any]] | None = None
        self._replaced_at_removal: dict[str, str] = {}  # replaced(), as it was at removal
        # layers whose hooks hs.remove_hooks took while the scope was active (see stripped)
        self.stripped: set[str] = set()
        # layers a deep copy of the model ran while the scope was active (see ran_in_copy)
        self.copy_ran: set[str] = set()
        # layer -> the name of a thread that called it while the scope was active, whose calls
        # the hooks left alone (see acts_here): a worker thread the model's forward starts, or
        # another thread running the model meanwhile
        self.elsewhere: dict[str, str] = {}

    # -- registration -------------------------------------------------------------------------
    def _wrap(self, fn: Callable[..., Any], kind: str, layer: str) -> _Hook:
        if not self.active:
            raise RuntimeError(f"{self!r} was removed; create a new scope to add hooks")
        if isinstance(fn, _Hook):  # a feature's own hook class (a hot path without indirection)
            fn.owner, fn.kind, fn.layer, fn.scope_id = self.owner, kind, layer, self.id
            fn.thread = self.thread
            return fn
        if kind in ("tensor", "post_accumulate_grad"):
            return _GradHook(fn, self.owner, kind, layer, self.id)
        hook = _Hook(fn, self.owner, kind, layer, self.id)
        hook.thread = self.thread
        return hook

    def _keep(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle

    def _place(self, module: nn.Module, hook: _Hook) -> _Hook:
        """A hook on a module inside a compiled region: route the region's calls, make it opaque.
        A hook on a module of a model whose generate() may compile it by itself: hold its guard."""
        check_not_in_compiled_forward(module, hook.layer)
        self._hold_guard(module, hook.layer)
        region = region_of(module)
        if region is None:
            return _untraced(hook)
        release = region.acquire(module, hook.kind, hook.layer)
        self._on_remove.append(release)
        return _opaque(hook, region, release)

    def _hold_guard(self, module: nn.Module, layer: str) -> None:
        """Hold the guard of the generating model ``module`` belongs to (if any) until removal."""
        guard = generate_guard(module)
        if guard is not None:
            self._on_remove.append(guard.acquire(layer))

    def add_forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        layer: str,
        with_kwargs: bool = False,
        always_call: bool = False,
        prepend: bool = False,
    ) -> RemovableHandle:
        """``fn(module, args, output)`` (or ``fn(module, args, kwargs, output)``) after forward."""
        hook = self._place(module, self._wrap(fn, "forward", layer))
        return self._keep(
            module.register_forward_hook(
                hook, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call
            )
        )

    def add_forward_many(
        self,
        hooks: Iterable[tuple[nn.Module, _Hook, str]],
        *,
        pre: bool = False,
        always_call: bool = False,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> None:
        """Plain forward hooks ``(module, hook, layer)``, many at once: what a capture of every leaf
        registers. Same effect as :meth:`add_forward` (``pre=True``: :meth:`add_forward_pre`) per
        hook, without a handle object per hook (``with_kwargs``: the hook also gets the call's
        keyword arguments; ``prepend``: each hook runs before the module's hooks already there, as
        the methods' options).

        ``register_forward_hook`` without options does one thing: it puts the hook in the module's
        ``_forward_hooks`` under an id from ``RemovableHandle.next_id``, in order (with
        ``always_call``, also the id in ``_forward_hooks_always_called``; a pre-hook goes in
        ``_forward_pre_hooks``). This does the same, keeps ``(dict, id)`` for :meth:`remove`, and
        falls back to the public method for a module whose class overrides it (or whose hook dict
        is not a plain dict) and for a module inside a compiled region (its calls must be routed,
        see :meth:`_place`); a module of a model whose ``generate()`` may compile it holds that
        model's guard, as :meth:`_place` does.
        """
        if not self.active:
            raise RuntimeError(f"{self!r} was removed; create a new scope to add hooks")
        owner, scope_id, direct, thread = self.owner, self.id, self._direct, self.thread
        kind = "forward_pre" if pre else "forward"
        method = "register_forward_pre_hook" if pre else "register_forward_hook"
        public = getattr(nn.Module, method)
        attr = "_forward_pre_hooks" if pre else "_forward_hooks"
        kw_attr = attr + "_with_kwargs"
        routed = routing()  # any compiled region or generating model indexed at all
        dyn = _dynamo_compiled()  # a compiled caller may trace the hooks (_untraced)
        if routed:  # refused before any is placed: no hook left behind
            hooks = list(hooks)
            for module, _, layer in hooks:
                check_not_in_compiled_forward(module, layer)
        plain_types: set[type] = set()  # module classes that keep nn.Module's register method
        for module, hook, layer in hooks:
            hook.owner, hook.kind, hook.layer, hook.scope_id = owner, kind, layer, scope_id
            hook.thread = thread
            d = module.__dict__.get(attr)
            always = module.__dict__.get("_forward_hooks_always_called")
            kw = module.__dict__.get(kw_attr) if with_kwargs else None
            cls = module.__class__
            if cls not in plain_types and getattr(cls, method) is public:
                plain_types.add(cls)
            if (
                cls not in plain_types
                or d.__class__ is not OrderedDict
                or (always_call and always.__class__ is not OrderedDict)
                or (with_kwargs and kw.__class__ is not OrderedDict)
                or (routed and region_of(module) is not None)
            ):
                placed = self._place(module, hook)
                if pre:
                    self._keep(
                        module.register_forward_pre_hook(
                            placed, prepend=prepend, with_kwargs=with_kwargs
                        )
                    )
                else:
                    self._keep(
                        module.register_forward_hook(
                            placed,
                            prepend=prepend,
                            always_call=always_call,
                            with_kwargs=with_kwargs,
                        )
                    )
                continue
            if routed:  # a module of a model whose generate() may compile it
                self._hold_guard(module, layer)
            hid = RemovableHandle.next_id
            RemovableHandle.next_id = hid + 1
            d[hid] = _untraced(hook) if dyn else hook
            if prepend:
                d.move_to_end(hid, last=False)
            direct.append((d, hid))
            if always_call:
                always[hid] = True
                direct.append((always, hid))
            if with_kwargs:
                kw[hid] = True
                direct.append((kw, hid))

    def add_forward_pre(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        layer: str,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> RemovableHandle:
        """``fn(module, args)`` (or ``fn(module, args, kwargs)``) before forward."""
        hook = self._place(module, self._wrap(fn, "forward_pre", layer))
        return self._keep(
            module.register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs)
        )

    def add_full_backward(
        self, module: nn.Module, fn: Callable[..., Any], *, layer: str
    ) -> RemovableHandle:
        """``fn(module, grad_input, grad_output)``: a full backward hook, for callers that need one.

        hookscope's own features never use it (tensor hooks are in-place safe, docs/pitfalls.md §3-5), and
        the legacy ``register_backward_hook`` is never used at all (docs/pitfalls.md §1).
        """
        if getattr(module, "_is_full_backward_hook", None) is False:
            raise HookConflictError(
                f"layer {layer!r} ({type(module).__name__}) has had a legacy register_backward_hook; "
                "PyTorch then refuses full backward hooks on it, even after that hook was removed. "
                "Rebuild the module, or use hookscope's gradient capture (tensor hooks), which is unaffected"
            )
        hook = self._place(module, self._wrap(fn, "backward", layer))
        return self._keep(module.register_full_backward_hook(hook))

    def add_tensor_hook(
        self, tensor: torch.Tensor, fn: Callable[[torch.Tensor], Any], *, layer: str
    ) -> RemovableHandle:
        """``fn(grad) -> new_grad | None`` on a tensor, kept and removed with the scope (parameters).

        For activations use :meth:`add_activation_grad_hook`, which does not keep a handle.
        """
        hook = self._wrap(fn, "tensor", layer)
        return self._keep(tensor.register_hook(hook))

    def add_activation_grad_hook(
        self, tensor: torch.Tensor, fn: Callable[[torch.Tensor], Any], *, layer: str
    ) -> None:
        """A gradient hook on an activation: lives as long as the autograd graph, inert once removed.

        Keeping a handle per activation would grow without bound in a training loop; instead the
        hook checks the scope and does nothing after :meth:`remove`.
        """
        scope = self

        def guarded(grad: torch.Tensor) -> Any:
            if scope.active:
                return fn(grad)
            return None

        tensor.register_hook(_GradHook(guarded, self.owner, "tensor", layer, self.id))

    def add_view_grad_hook(self, view: torch.Tensor, fn: Callable[[Any], Any]) -> None:
        """``fn(grad)`` with the gradient of ``view``, an identity view the caller made for this
        hook alone (``t.view_as(t)``): a pre-hook of the view's own backward node, which has that
        one input gradient (half the cost of ``Tensor.register_hook``, which keeps a handle and a
        hook dict per tensor); a tensor subclass (DTensor) through ``register_hook``. No handle is
        kept (it lives as long as the graph): ``fn`` checks its scope itself (inert once removed)
        and skips ``None``. PyTorch drops either kind of hook if the view is changed in place."""
        node = view.grad_fn
        if view.__class__ is torch.Tensor and node is not None:
            node.register_prehook(_FirstGrad(fn))
        else:
            view.register_hook(fn)

    def add_node_hook(self, node: Any, fn: Callable[..., Any], *, pre: bool) -> None:
        """A hook on an autograd node itself (``pre``: ``fn(grad_outputs)`` before it runs; else
        ``fn(grad_inputs, grad_outputs)`` after), for a gradient no tensor hook can see (a view
        changed in place loses its own: the node that made its base still runs). As with
        :meth:`add_view_grad_hook`, no handle is kept (it lives as long as the graph) and ``fn``
        checks its scope itself (inert once removed) and returns ``None``."""
        if pre:
            node.register_prehook(fn)
        else:
            node.register_hook(fn)

    def add_post_accumulate_grad(
        self, param: torch.Tensor, fn: Callable[[torch.Tensor], None], *, layer: str
    ) -> RemovableHandle:
        """``fn(param)`` after ``param.grad`` was accumulated (docs/pitfalls.md §7 and §19)."""
        hook = self._wrap(fn, "post_accumulate_grad", layer)
        return self._keep(param.register_post_accumulate_grad_hook(hook))

    def on_remove(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` when the scope is removed (release per-scope state)."""
        self._on_remove.append(fn)

    # -- where the hooks sit ----------------------------------------------------------------------
    def track(
        self,
        model: nn.Module,
        modules: Mapping[str, nn.Module] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Remember that this scope's hooks of layer ``name`` sit on ``modules[name]`` (and those
        of parameter ``name`` on ``params[name]``), found at that name in ``model``, so that
        :meth:`replaced` can tell when the model holds another object there now (``model.fc =
        nn.Linear(...)`` while the scope is open: the new module runs without its hooks). Held
        weakly; nothing is added to the hooks' path: the check runs when asked and once at
        removal (:meth:`replaced` of a removed scope answers as it was then)."""
        if self._places is None:
            self._places = (weakref.ref(model), {}, {})
        mods, prms = self._places[1], self._places[2]
        if modules:
            mods.update(zip(modules, map(weakref.ref, modules.values())))
        if params:
            prms.update(zip(params, map(weakref.ref, params.values())))

    def watch_unrouted(self, model: nn.Module, names: Iterable[str], what: str) -> None:
        """Never silently nothing: warn, once, when ``model`` is called through a
        ``torch.compile`` wrapper hookscope was not given (``cm = torch.compile(model)``; the
        scope opened on ``model``, ``cm`` called). The wrapper's compiled code skips the hooks
        on the layers inside (pytorch#117758): a watching product (observe, trace, the monitor)
        would see no calls of them and say nothing. One hook on the model, checked at its calls
        until it warned (a walk of a few frames), placed only where Dynamo compiled something
        before the scope opened."""
        if not _dynamo_compiled() or is_optimized(model) or region_of(model) is not None:
            # nothing compiled yet (code compiled from now on traces the hooks in), the object
            # called, or a compiled part hookscope routes
            return
        done: list[bool] = []
        label = some_names(sorted(n for n in names if n)) if any(names) else "'<root>'"
        owner, kind = self.owner, type(model).__name__

        @torch._dynamo.disable  # (a traced hook would not see the frames it runs in)
        def check(module: nn.Module, args: Any) -> None:
            if done or not unrouted_wrapper(module):
                return
            done.append(True)
            warnings.warn(
                f"{owner}: {kind} was called through a torch.compile wrapper of it that "
                f"hookscope was not given, whose compiled code skips hooks added after it was "
                f"compiled (pytorch#117758): layers {label} are not {what} in the calls it runs "
                f"from that code. Give hookscope the "
                f"object you call ({owner}(compiled_model, ...), compiled_model = "
                f"torch.compile({kind.lower()}), names unchanged), or call the model itself",
                HookscopeWarning,
                stacklevel=2,
            )

        self.add_forward_pre(model, check, layer="")

    def replaced(self, name: str) -> str | None:
        """If the model no longer holds, at ``name``, the module (or parameter) this scope hooked
        there (see :meth:`track`): what it holds now, for a message (``"model.fc is now another
        Linear"``); else ``None``. For a removed scope: as it was when it was removed."""
        if not self.active:
            return self._replaced_at_removal.get(name)
        if self._places is None:
            return None
        return self._check_places([name], {}).get(name)

    def replaced_all(self) -> dict[str, str]:
        """:meth:`replaced` of every tracked name, ``{name: what the model holds there now}``,
        for those whose module (or parameter) is not the one hooked."""
        if not self.active:
            return dict(self._replaced_at_removal)
        if self._places is None:
            return {}
        return self._check_places([*self._places[1], *self._places[2]], {})

    def _check_places(self, names: Iterable[str], memo: dict[str, Any]) -> dict[str, str]:
        """:meth:`replaced` for each of ``names`` (the tracked ones), walking the model's own
        ``_modules`` / ``_parameters`` by name (``memo``: the modules found so far, by name)."""
        places = self._places
        model = places[0]() if places is not None else None
        if model is None or places is None:  # (the model is gone: nothing runs unhooked)
            return {}
        mods, prms = places[1], places[2]
        found: dict[str, str] = {}
        full: dict[str, Any] = {}  # named_modules / named_parameters, built on a first mismatch
        for name in names:
            ref = mods.get(name)
            is_param = ref is None
            if is_param:
                ref = prms.get(name)
                if ref is None:
                    continue
            hooked = ref()
            parent, _, last = name.rpartition(".")
            owner = memo.get(parent, _NOT_FOUND)
            if owner is _NOT_FOUND:
                owner = _module_at(model, parent, memo)
            if is_param:
                kept = getattr(owner, "_parameters", None)
                now = kept.get(last) if isinstance(kept, dict) else None
            elif name:
                kept = getattr(owner, "_modules", None)
                now = kept.get(last) if isinstance(kept, dict) else None
                if now is not hooked and now is not None:  # (a torch.compile wrapper: its module)
                    now = strip_compiled(now)
            else:
                now = strip_compiled(model)
            if now is hooked and hooked is not None:
                continue
            if not full:  # a class that names its parts in its own way: ask it
                full["m"] = dict(named_modules(model))
                full["p"] = dict(named_parameters(model))
            now = full["p" if is_param else "m"].get(name)
            if now is hooked and hooked is not None:
                continue
            if is_param and now is None and any(p is hooked for p in full["p"].values()):
                continue  # moved, not replaced (a parametrization's .original): its hook acts
            found[name] = _describe_place(name, hooked, now, is_param)
        return found

    def _note_stripped(self, layers: Iterable[str]) -> None:
        """hs.remove_hooks took this scope's hooks of ``layers`` while it was active."""
        if self.active:
            self.stripped.update(layers)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def num_hooks(self) -> int:
        """Number of hooks this scope holds on modules and parameters (those still registered:
        ``hs.remove_hooks`` may have taken some while the scope was open)."""
        held = 0
        for h in self._handles:
            d = h.hooks_dict_ref()
            held += d is not None and h.id in d
        return held + sum(1 for d, hid in self._direct if hid in d)

    def stop_signal(self) -> _StopSignal:
        """The exception a hook raises to end the forward pass early; this scope swallows it."""
        return _StopSignal(self.id)

    def remove(self) -> None:
        """Remove every hook of this scope. Safe to call several times."""
        if not self.active:
            return
        self._replaced_at_removal = self.replaced_all()  # what replaced() says from now on
        self.active = False
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        direct, self._direct = self._direct, []
        for d, hid in direct:
            d.pop(hid, None)
        callbacks, self._on_remove = self._on_remove, []
        for cb in callbacks:
            cb()

    close = remove

    def __enter__(self) -> HookScope:
        enter_once(self, self.owner, self.active)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        stopped = isinstance(exc, _StopSignal) and exc.scope_id == self.id
        self.failed = exc is not None and not stopped
        self.remove()
        return stopped

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<{type(self).__name__} {self.owner!r} #{self.id} {state}, {self.num_hooks} hooks>"


_NOT_FOUND = object()


def _module_at(model: nn.Module, name: str, memo: dict[str, Any]) -> Any:
    """The module at dotted ``name`` of ``model`` (hookscope's names: a ``torch.compile``
    wrapper and the module it wraps share one), through each module's ``_modules``; ``None``
    when there is none. ``memo`` keeps the modules found, by name, for the next names."""
    found = memo.get(name, _NOT_FOUND)
    if found is not _NOT_FOUND:
        return found
    if not name:
        found = strip_compiled(model)
    else:
        parent, _, last = name.rpartition(".")
        owner = _module_at(model, parent, memo)
        children = getattr(owner, "_modules", None)
        found = children.get(last) if isinstance(children, dict) else None
        if found is not None and found.__class__.__name__ == "OptimizedModule":
            found = strip_compiled(found)
    memo[name] = found
    return found


def attribute_path(name: str) -> str:
    """``"layers.0.fc"`` as the code that reaches it writes it: ``model.layers[0].fc``."""
    if not name:
        return "model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in name.split("."))


def stale_names(model: nn.Module, named: Mapping[str, nn.Module]) -> list[str]:
    """The names of ``named`` (``{name: module}`` found in ``model`` earlier) at which ``model``
    holds another module now, or none (``model.fc = nn.Linear(...)`` since): a selection kept
    between scopes (``FeatureExtractor``'s) is resolved again when one is stale. One dict
    lookup per name (the model's own ``_modules``), ``named_modules`` only on a mismatch."""
    memo: dict[str, Any] = {}
    stale = [name for name, module in named.items() if _module_at(model, name, memo) is not module]
    if stale:  # a class that names its parts in its own way: ask it
        everything = dict(named_modules(model))
        stale = [n for n in stale if everything.get(n) is not named[n]]
    return stale


_GONE = " is no longer in the model"


def lost_layers(
    scope: HookScope,
    known: Iterable[str] | None = None,
    watch: Callable[[nn.Module], bool] | None = None,
) -> dict[str, str]:
    """The layers whose calls ``scope``'s hooks no longer see, ``{name: what happened}``: a
    module the tracked model (:meth:`HookScope.track`) holds no longer at its name
    (:meth:`HookScope.replaced_all`: the new one runs unhooked), hooks ``hs.remove_hooks`` took
    (:attr:`HookScope.stripped`; the text ends with ``"hs.remove_hooks"``) and, with ``known``
    (the model's module names when the hooks were placed), a module added to the model since
    (one walk of the model; ``watch(module)``: whether such a module would have been hooked).
    Asked once a run is over, never from the hooks."""
    found = scope.replaced_all()
    for name in sorted(scope.stripped):
        if name not in found:
            found[name] = f"the hooks on {attribute_path(name)} were removed by hs.remove_hooks"
    model = scope._places[0]() if known is not None and scope._places is not None else None
    if model is not None:
        known = set(known)  # type: ignore[arg-type]
        for name, module in named_modules(model):
            if name not in known and name not in found and (watch is None or watch(module)):
                found[name] = (
                    f"{attribute_path(name)} was added to the model (a {type(module).__name__})"
                )
    return found


def _describe_place(name: str, hooked: Any, now: Any, is_param: bool) -> str:
    """What the model holds at ``name`` instead of ``hooked`` (a dead reference: ``None``)."""
    where = attribute_path(name)
    if now is None:
        return f"{where}{_GONE}"
    if is_param:
        return f"{where} is now another {type(now).__name__} (shape {tuple(now.shape)})"
    if hooked is None:
        return f"{where} is now another module, a {type(now).__name__}"
    if type(now) is type(hooked):
        return f"{where} is now another {type(now).__name__}"
    return f"{where} is now a {type(now).__name__}, not the {type(hooked).__name__} hooked there"


def warn_lost(
    scope: HookScope,
    names: Iterable[str],
    owner: str,
    verb: str,
    acted: Mapping[str, int] | None = None,
    stacklevel: int = 5,
    threads: bool = True,
) -> set[str]:
    """At the removal of ``scope`` (an :meth:`HookScope.on_remove` callback): warn
    (:class:`HookscopeWarning`) for the ``names`` whose hooks stopped acting while it was open,
    and return them. A module (or parameter) the model no longer holds at that name
    (:meth:`HookScope.replaced`: the new one ran without the hooks), or hooks that
    ``hs.remove_hooks`` took (:attr:`HookScope.stripped`). ``verb`` says what the hooks do
    (``"edited"``, ``"observed"``); ``acted``: the calls each layer's hook acted on, to say
    whether it acted before ``hs.remove_hooks``; ``stacklevel``: the user's frame, as
    :func:`warnings.warn` counts from here (5: an ``on_remove`` callback of a ``with`` block's
    exit). With ``threads``, also the layers a worker thread the forward started ran
    (:func:`warn_elsewhere`). Nothing when an exception ends the scope."""
    if scope.failed or sys.exc_info()[1] is not None:
        return set()  # an exception is on its way: it says more than a warning
    names = set(names)
    replaced = {n: v for n, v in scope.replaced_all().items() if n in names}
    stripped = sorted(n for n in scope.stripped if n in names and n not in replaced)
    places = scope._places
    params = places[2] if places is not None else {}

    def kind(some: Iterable[str]) -> str:
        return "parameter(s)" if all(n in params for n in some) else "layer(s)"

    if replaced:
        first = next(iter(replaced))
        gone = replaced[first].endswith(_GONE)  # (removed, not replaced: nothing runs there)
        warnings.warn(
            f"{owner}: {kind(replaced)} {some_names(list(replaced))} were "
            f"{'removed from the model' if gone else 'replaced'} while the scope was open "
            f"({replaced[first]}), so "
            f"{'its later uses were' if gone else 'the new one was'} not {verb}: the scope's "
            f"hooks stay on what was there; open the scope after "
            f"{'removing' if gone else 'replacing'} {attribute_path(first)}",
            HookscopeWarning,
            stacklevel=stacklevel,
        )
    if stripped:
        before = ""
        if acted is not None and any(n in acted for n in stripped):
            did = [n for n in stripped if acted.get(n)]
            before = f" ({some_names(did)} {verb} before that)" if did else " (nor before that)"
        warnings.warn(
            f"{owner}: the hooks of this {owner} were removed by hs.remove_hooks(...) while it "
            f"was open, so {kind(stripped)} {some_names(stripped)} were not {verb} after "
            f"that{before}; keep hs.remove_hooks for scopes that were never closed, or open a "
            f"new {owner} after it",
            HookscopeWarning,
            stacklevel=stacklevel,
        )
    away = (
        warn_elsewhere(
            scope, names - set(replaced) - set(stripped), owner, verb, acted, stacklevel + 1
        )
        if threads
        else []
    )
    return {*replaced, *stripped, *away}


def warn_elsewhere(
    scope: HookScope,
    names: Iterable[str],
    owner: str,
    verb: str,
    acted: Mapping[str, int] | None = None,
    stacklevel: int = 6,
) -> list[str]:
    """Warn (:class:`HookscopeWarning`) for the ``names`` that a worker thread the model's
    forward started ran while ``scope`` was open (:attr:`HookScope.elsewhere`): the scope's
    hooks left those calls alone, so they were not ``verb``; return the outermost such names.
    ``acted``: the calls each layer's hook acted on (in the scope's own thread)."""
    away = {n: t for n, t in scope.elsewhere.items() if n in set(names)}
    if not away:
        return []
    outer = [n for n in away if not any(p in away for p in ancestors(n))]
    also = [n for n in outer if acted and acted.get(n)]
    warnings.warn(
        f"{owner}: {some_names(outer)} ran in thread {away[outer[0]]!r}, which the model's "
        f"forward started and waited on, while the {owner} was open: a scope acts only on the "
        "calls of the thread that opened it (docs/guide/core.md, Threads), so those calls were "
        f"not {verb}"
        + (f" ({some_names(also)} were, in this thread)" if also else "")
        + "; run them in the forward's own thread (or open the scope inside the worker)",
        HookscopeWarning,
        stacklevel=stacklevel,
    )
    return outer


def ancestors(name: str) -> Iterator[str]:
    """The dotted names above ``name`` (``''``, the root, included)."""
    while name:
        name = name.rpartition(".")[0]
        yield name


def note_stripped(removed: Mapping[int, set[str]]) -> None:
    """``hs.remove_hooks`` took the hooks ``{scope id: layers}``: each active scope of those ids
    remembers it (:attr:`HookScope.stripped`), so what it says later of those layers (nothing
    recorded, nothing edited) names the cause instead of "never ran"."""
    if not removed:
        return
    with _RUNS_LOCK:
        scopes = [s for s in list(_LIVE) if s.id in removed]
    for s in scopes:
        s._note_stripped(removed[s.id])


def locate_errors(model: nn.Module) -> HookScope:
    """Name the innermost layer (and its input shapes) in any exception the model raises.

    Adds one ``always_call`` forward hook per module that calls :func:`note_exception`; the
    command line wraps every model it runs in this scope, so a failing model is reported as one
    line naming the layer.
    """
    scope = HookScope("locate_errors")
    for name, module in named_modules(model):

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            if output is None and sys.exc_info()[1] is not None:
                note_exception(name, module, args, kwargs)

        scope.add_forward(module, hook, layer=name, with_kwargs=True, always_call=True)
    return scope


def warn_once(store: set[str], key: str, message: str) -> None:
    """Emit a :class:`HookscopeWarning` once per key (per scope)."""
    if key not in store:
        store.add(key)
        warnings.warn(message, HookscopeWarning, stacklevel=3)
