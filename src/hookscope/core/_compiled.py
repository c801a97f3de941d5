"""Hooks on ``torch.compile``'d models: the uncompiled names, the eager values, at compiled speed.

Dynamo ignores hooks added after a module was compiled: without guards on empty hook dicts
(``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default) the cached graph runs without
them (pytorch#117758). hookscope handles three forms of compilation, called *regions* here:

* ``torch.compile(model)``: an ``OptimizedModule`` wrapper whose ``_orig_mod`` is the model;
* ``model.compile()``: the module's ``_compiled_call_impl`` (compiled in place);
* a model containing either of the above as a submodule.

While a scope holds a hook on a module inside a region, calls of that region are routed through a
*hooked variant*: the same Dynamo context (backend, options) with its own cache
(``isolate_recompiles``), applied to a fresh code object, so the original compiled graph is left
untouched and keeps serving every call made without hookscope. The
hooks placed inside a region are opaque to Dynamo (:func:`torch._dynamo.disable`): Dynamo breaks the
graph at each hooked layer and the hook runs eagerly on the real tensors, so values are exactly
eager hookscope's; everything between hooked layers stays compiled. One variant is compiled per
(region, set of hooked modules), cached, so opening and closing the same scope again compiles
nothing. The root's own hooks run outside the variant, eagerly, around its compiled ``forward``.
A ``fullgraph=True`` region cannot break its graph: that region runs eagerly while the
scope is open, with a :class:`HookscopeWarning` naming the layers.

A routed call swaps the root's ``forward`` and patches Dynamo's (process-wide) config and warning
filters for its duration, so routed calls run one at a time, under one lock: a compiled model
called from several threads while a scope is open gives every thread the exact values, one call
after the other, and leaves the model and Dynamo's config as found. ``copy.deepcopy`` of a
compiled model with a scope open works: the copy's hooks are inert (see ``core._scope``), a
``torch.compile`` wrapper is rebuilt around the copied module, and a module compiled in place
is copied uncompiled (PyTorch drops ``_compiled_call_impl`` when copying).
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import sys
import threading
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ._errors import HookscopeWarning, UnsupportedModelError

__all__ = [
    "NONE_RAN",
    "GenerateGuard",
    "Region",
    "clean_name",
    "compiled_regions",
    "generate_guard",
    "index_generate",
    "is_optimized",
    "named_modules",
    "named_parameters",
    "region_of",
    "routing",
    "strip_compiled",
    "unrouted_wrapper",
]

# how the warning of a routed call in which no hook of the region ran begins (Region._silent):
# a check that runs a region to count such calls itself filters it out
NONE_RAN = "hookscope: none of the hooks on layers"

_ORIG = "_orig_mod"
_MISSING = object()
_NON_LEAF = "The .grad attribute of a Tensor that is not a leaf Tensor"


def is_optimized(module: nn.Module) -> bool:
    """True for the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, _ORIG, None), nn.Module
    )


def strip_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (unwrapping nested wrappers); else ``module``."""
    while is_optimized(module):
        module = module._orig_mod
    return module


def clean_name(name: str) -> str:
    """``name`` without ``_orig_mod`` segments (the uncompiled model's name)."""
    if _ORIG not in name:
        return name
    return ".".join(p for p in name.split(".") if p != _ORIG)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` with the uncompiled model's names: no ``_orig_mod`` segments.

    A ``torch.compile`` wrapper and the module it wraps share one name; the wrapped module is the
    one given (its type, its hooks, its children), so a compiled model reads like the eager one.
    """
    seen: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if is_optimized(module):
            continue  # its _orig_mod comes next, under the same clean name
        seen.setdefault(clean_name(name), module)
    yield from seen.items()


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` with the uncompiled model's names."""
    for name, p in model.named_parameters():
        yield clean_name(name), p


_CALL_FRAMES = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})


def unrouted_wrapper(model: nn.Module, depth: int = 12) -> bool:
    """Whether this call of ``model`` (asked from a hook on it, run eagerly) comes through a
    ``torch.compile`` wrapper of it that hookscope does not route: one it was not given
    (``cm = torch.compile(model)`` called, ``model`` handed to hookscope). That wrapper's compiled
    code does not run hooks added after it was compiled (pytorch#117758). A walk of a few frames,
    reading ``self`` only in ``nn.Module``'s call frames."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name in _CALL_FRAMES:
            owner = f.f_locals.get("self")
            if owner is not model and is_optimized(owner) and strip_compiled(owner) is model:
                region = _regions.get(owner)
                return region is None or not region.hooked
        f = f.f_back
    return False


# -- regions ------------------------------------------------------------------------------------
_code_ids = itertools.count(1)


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: Dynamo caches per code object, so each hooked
    variant has its own cache entries and recompile budget, apart from the original graph's."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_code_ids)}")
    twin = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    return twin


def _forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(mod).forward(mod, *args, **kwargs)


def _variant_fn(root: nn.Module) -> Callable[..., Any]:
    """The function a variant compiles: the root's ``forward``, on a fresh code object.

    The fresh code is the root class's ``forward`` itself, copied, not a function calling it:
    where Dynamo gives up tracing a frame (a graph break it cannot resume, such as a hook inside
    a loop over a ``ModuleList``) it runs that frame eagerly and evaluates each call in it as a
    frame of its own. A ``forward`` reached that way is the original compile's top frame, whose
    entries (compiled without hooks, not guarding on them) an isolated cache falls back to: the
    hooks inside it were skipped while those outside it ran. The copy has no such entries.

    ``nn.Sequential.forward`` calls its children in a loop, and Dynamo cannot resume a graph break
    (a hook) inside a loop: it would run the whole loop eagerly. A Sequential root gets its calls
    unrolled instead, one line per child, so the graph breaks only at the hooked children.
    """
    if type(root).forward is not nn.Sequential.forward:
        fwd = type(root).forward
        if (
            isinstance(fwd, types.FunctionType)
            and not hasattr(fwd, "__wrapped__")  # a decorated forward: call it as it is
            and not fwd.__code__.co_filename.startswith(os.path.dirname(torch.__file__))
        ):
            return _fresh(fwd)
        return _fresh(_forward)
    lines = [f"def _sequential_{next(_code_ids)}(mod, input):", "    c = list(mod)"]
    lines += [f"    input = c[{i}](input)" for i in range(len(root))]
    lines.append("    return input")
    scope: dict[str, Any] = {}
    exec("\n".join(lines), scope)  # generated from the length only
    return next(v for k, v in scope.items() if k.startswith("_sequential_"))


def _dynamo_ctx(compiled_fn: Any) -> Any:
    """The Dynamo context of a function returned by ``torch.compile`` (None if not found)."""
    code = getattr(compiled_fn, "__code__", None)
    if code is None or compiled_fn.__closure__ is None or "self" not in code.co_freevars:
        return None
    ctx = compiled_fn.__closure__[code.co_freevars.index("self")].cell_contents
    return ctx if callable(ctx) and hasattr(ctx, "fullgraph") else None


def _variant_config(hooked: int) -> Any:
    """Dynamo's settings while a variant runs.

    A graph break at a hook resumes in the hooked module's own frame (by default it bubbles up to
    the top frame); every frame compiled guards on module hook dicts, empty ones included, so a
    frame compiled for one set of hooked layers is never reused for another; and since a hooked
    module's own frame is compiled once per distinct configuration (each conv stride, say), the
    per-code recompile limit grows with the number of hooked modules.
    """
    cfg = torch._dynamo.config
    return cfg.patch(
        nested_graph_breaks=True,
        skip_nnmodule_hook_guards=False,
        recompile_limit=max(cfg.recompile_limit, hooked + 8),
    )


def _isolated(ctx: Any) -> Any:
    """A copy of a Dynamo context with its own cache bucket (``isolate_recompiles``).

    Every frame Dynamo evaluates under it, shared code such as ``Module._call_impl`` or the model's
    ``forward`` included, gets its own cache entries, and the variant's are never run by an
    unhooked call. The other way round Dynamo falls back, read-only, to the original compile's
    entries of the code a variant runs, which do not guard on hooks: where that code is a resume
    function after a graph break, the region runs eagerly instead (:meth:`Region._stale`).
    """
    counter = getattr(torch._dynamo.eval_frame, "_next_isolate_recompiles_id", None)
    if counter is None or not hasattr(ctx, "_isolate_recompiles_id"):
        return ctx  # older torch: the fresh code object and the hook guards still separate them
    twin = copy.copy(ctx)
    twin._isolate_recompiles_id = next(counter)
    return twin


def _hold(counter: Counter[Any], key: Any, on_empty: Callable[[], None]) -> Callable[[], None]:
    """Count one holder of ``key``; return its release, idempotent (the scope's removal or
    remove_hooks(), whichever comes first), which calls ``on_empty`` when no holder is left."""
    counter[key] += 1
    done = False

    def release() -> None:
        nonlocal done
        if done:
            return
        done = True
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]
        if not counter:
            on_empty()

    return release


# routed calls swap module attributes and patch process-wide settings: one at a time (reentrant:
# a hook may call another compiled model)
_routing = threading.RLock()


class Region:
    """One compiled part of a model, and how hookscope routes its calls while hooks are on it."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        self.name = name  # the clean name of the region's root
        self._owner = weakref.ref(owner)  # the OptimizedModule, or the module compiled in place
        self.in_place = not is_optimized(owner)
        if self.in_place:
            compiled = owner._compiled_call_impl
        else:
            compiled = owner.forward
        self.ctx = _dynamo_ctx(compiled)
        if self.ctx is None and not self.in_place:
            self.ctx = getattr(owner, "dynamo_ctx", None)
        self.fullgraph = bool(getattr(self.ctx, "fullgraph", False))
        self.hooked: Counter[tuple[int, str]] = Counter()  # (id(module), kind) -> hooks held
        self.layers: dict[int, str] = {}
        self._variants: dict[tuple[frozenset[tuple[int, str]], int], Callable[..., Any]] = {}
        self._saved: Any = None
        self._warned = False
        self._warned_stale = False
        self._codes: list[Any] | None = None  # the code of the region's modules (see _stale)
        # Dynamo's count of frames compiled at the last _stale walk, and its verdict
        self._stale_stamp: int | None = None
        self._stale_verdict = False
        self.fired = 0  # opaque hooks of this region run so far (checked after each routed call)

    @property
    def root(self) -> nn.Module:
        owner = self._owner()
        assert owner is not None
        return owner if self.in_place else owner._orig_mod

    def acquire(self, module: nn.Module, kind: str, layer: str) -> Callable[[], None]:
        """Count one hook on ``module`` inside this region; return its release."""
        self.layers[id(module)] = layer
        if not self.hooked:
            self._install()
        return _hold(self.hooked, (id(module), kind), self._uninstall)

    # The routed call replaces the region's entry point while hooks are held.
    def _install(self) -> None:
        owner = self._owner()
        if owner is None:
            return
        ref = weakref.ref(self)

        def routed(*args: Any, **kwargs: Any) -> Any:
            region = ref()
            assert region is not None
            return region._call(*args, **kwargs)

        attr = "_compiled_call_impl" if self.in_place else "forward"
        self._saved = owner.__dict__.get(attr, _MISSING)
        owner.__dict__[attr] = routed

    def _uninstall(self) -> None:
        owner = self._owner()
        if owner is None:
            return
        attr = "_compiled_call_impl" if self.in_place else "forward"
        if self._saved is _MISSING:
            owner.__dict__.pop(attr, None)
        else:
            owner.__dict__[attr] = self._saved
        self._saved = None

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        with _routing:
            return self._call_routed(*args, **kwargs)

    def _call_routed(self, *args: Any, **kwargs: Any) -> Any:
        root = self.root
        if self.ctx is None or self.fullgraph:
            if self.fullgraph and not self._warned:
                self._warned = True
                names = self._names()
                warnings.warn(
                    f"layers {names} are inside a torch.compile(fullgraph=True) region "
                    f"({self.name or '<root>'!r}), where hooks cannot run between graphs: hookscope runs "
                    "that region eagerly while its hooks are on it (exact values, eager speed). "
                    "Compile without fullgraph=True to keep the rest of the region compiled",
                    HookscopeWarning,
                    stacklevel=5,
                )
            return root._call_impl(*args, **kwargs) if self.in_place else root(*args, **kwargs)
        if self._stale(root):
            return self._call_eagerly(root, *args, **kwargs)
        key = (frozenset(self.hooked), len(root) if isinstance(root, nn.Sequential) else -1)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = _isolated(self.ctx)(_variant_fn(root))
        before = self.fired
        # The root's own hooks run here, eagerly (a graph break in _call_impl's hook loops would
        # make Dynamo give up the whole top frame); its forward, with the hooks of every module
        # inside, runs as the compiled variant.
        saved = root.__dict__.get("forward", _MISSING)
        root.__dict__["forward"] = functools.partial(variant, root)
        try:
            with _variant_config(len(self.hooked)), warnings.catch_warnings():
                # Dynamo reads .grad of non-leaf tensors it resumes with (a torch-internal warning)
                warnings.filterwarnings("ignore", message=_NON_LEAF, category=UserWarning)
                out = root._call_impl(*args, **kwargs)
        finally:
            if saved is _MISSING:
                del root.__dict__["forward"]
            else:
                root.__dict__["forward"] = saved
        if self.fired == before and self.hooked:
            self._silent()
        return out

    def _stale(self, root: nn.Module) -> bool:
        """Whether a hooked variant could run code the original compile made without the hooks.

        An isolated cache (:func:`_isolated`) still falls back, read-only, to the default cache
        entries of the code it runs, and the original compile's entries do not guard on hook
        dicts. The variant's own code is fresh, but resuming after a graph break inside a
        module's ``forward`` (a ``print``, data-dependent control flow, ``.item()``) runs a resume
        function of that shared ``forward``, the one the original compile made: once the model
        has been called compiled without hooks, the layers after the break ran without their
        hooks (a capture missed them, an edit did not act), while those before it fired. The
        same holds for a module's ``forward`` the original compile ran as a frame of its own, and
        for any other function the model calls that it ran as one (a helper called in a loop
        that has a graph break, ``def step(block, x): return block(x)``): a variant giving up a
        frame runs the calls in it as frames, which reuse those entries. Such functions are
        found statically (:func:`_module_codes`): the modules' methods, the functions and
        helper objects they hold, and what those name. A helper reached only dynamically (by a
        name in a string, from a registry) is not found. Code compiled elsewhere (a compiled
        loss in the model's file) does not count: the variant never runs it.
        """
        cache = _resume_cache()
        lookup = _default_entries()
        if cache is None or lookup is None:
            return False
        # entries appear only when Dynamo compiles a frame: while it has compiled none since the
        # last check, the verdict stands (the walk below costs ~1 ms a call on a Transformers
        # model: the code its modules reach)
        stamp = _compiled_frames()
        if stamp is not None and stamp == self._stale_stamp:
            return self._stale_verdict
        verdict = self._stale_walk(root, cache, lookup)
        self._stale_stamp, self._stale_verdict = stamp, verdict
        return verdict

    def _stale_walk(self, root: nn.Module, cache: Any, lookup: Any) -> bool:
        """:meth:`_stale`'s walk of the code the region's modules reach."""
        if self._codes is None:
            self._codes = _module_codes(root)
        # the original compile's top frame (the root's forward; _call_impl when compiled in
        # place) has default entries by design: only the code resumed or run inside it counts
        tops = {getattr(type(root).forward, "__code__", None)}
        if self.in_place:
            tops.add(nn.Module._call_impl.__code__)
        todo = list(self._codes)
        seen: set[Any] = set()
        while todo:
            code = todo.pop()
            if code in seen:
                continue
            seen.add(code)
            if code not in tops and lookup(code, -1):
                return True
            if code in cache:
                todo.extend(cache[code].values())
        return False

    def _call_eagerly(self, root: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The call without compiled code (exact values, eager speed), warning once per region."""
        if not self._warned_stale:
            self._warned_stale = True
            warnings.warn(
                f"layers {self._names()} are inside the compiled region "
                f"{self.name or '<root>'!r}, whose compiled code has graph breaks and already ran "
                "without these hooks: Dynamo would reuse that code after a graph break and skip "
                "the hooks there, so hookscope runs the region's calls eagerly while its hooks "
                "are on (exact values, eager speed). To keep them compiled, add the hooks before "
                "the first compiled call, or call torch._dynamo.reset() before adding them",
                HookscopeWarning,
                stacklevel=6,
            )
        with torch.compiler.set_stance("force_eager"):
            return root._call_impl(*args, **kwargs) if self.in_place else root(*args, **kwargs)

    def _names(self) -> str:
        return ", ".join(
            repr(n or "<root>") for n in sorted({self.layers[i] for i, _ in self.hooked})
        )

    def _silent(self) -> None:
        """Never silent: a routed call in which no hook of the region ran."""
        names = self._names()
        warnings.warn(
            f"{NONE_RAN} {names} ran during this call of the compiled "
            f"region {self.name or '<root>'!r}. Either those layers are not called through "
            "module(...) for this input, or the compiled code skipped them (code compiled by an "
            "earlier call: torch._dynamo.reset() before adding the hooks recompiles it with "
            "them); to get exact values anyway run the call under "
            "torch.compiler.set_stance('force_eager')",
            HookscopeWarning,
            stacklevel=6,
        )


def _resume_cache() -> Any:
    """Dynamo's resume functions, ``{code: {key: resume code}}`` (None where unknown)."""
    if getattr(torch.compiler, "set_stance", None) is None:
        return None  # (no eager fallback either: torch < 2.6)
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache
    except ImportError:
        return None
    return getattr(ContinueExecutionCache, "cache", None)


def _default_entries() -> Callable[[Any, int], Any] | None:
    """``(code, -1) -> the default (non-isolated) cache entries of code`` (None where unknown)."""
    return getattr(torch._C._dynamo.eval_frame, "_get_cache_entries_for_region", None)


def _compiled_frames() -> int | None:
    """How many frames Dynamo has compiled (or tried to) in this process: its cache entries
    change only when this does (``None`` where the counter cannot be read)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["total"])
    except Exception:  # another torch: walk every time
        return None


def _module_codes(root: nn.Module) -> list[Any]:
    """The code a region's module calls run in: each module class's ``forward`` and
    ``nn.Module``'s call path, and the Python functions they may call (:func:`_called`)."""
    codes = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    own = os.path.dirname(torch.__file__)
    todo: list[Any] = []
    for cls in {type(m) for m in root.modules()}:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is not None:
            codes.add(code)
        todo += _methods(cls)  # helpers forward calls as methods
    for m in root.modules():  # functions and helper objects held by the modules (self.fn(...))
        for value in vars(m).values():
            todo += _callables_of(value)
    codes.update(_called(todo, own))
    return list(codes)


def _methods(cls: type) -> list[Any]:
    """The functions defined by ``cls`` and its bases, ``nn.Module`` and ``object`` left out."""
    out: list[Any] = []
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for f in vars(klass).values():
            f = getattr(f, "__func__", f)  # staticmethod, classmethod
            if isinstance(f, types.FunctionType):
                out.append(f)
    return out


def _callables_of(value: Any) -> list[Any]:
    """The Python functions a value held by a module or a model's code may run: a function, a
    bound method's function, a partial's, or the methods of a plain helper object's class
    (tensors, modules and containers left out: their code is torch's or the modules')."""
    value = getattr(value, "func", value)  # functools.partial
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, types.MethodType):
        return [value.__func__]
    if isinstance(value, (type, types.ModuleType, torch.Tensor, nn.Module, dict, list, tuple)):
        return []
    cls = type(value)
    if getattr(cls, "__module__", "builtins") == "builtins":
        return []
    return _methods(cls)


def _called(fns: list[Any], own: str, limit: int = 2000) -> set[Any]:
    """The code of ``fns`` and of the Python functions they name, transitively, found
    statically: global names (``from helpers import step``), closures and nested functions;
    functions in ``own`` (torch's package) are left out. An over-approximation: a function
    named but never called costs nothing unless Dynamo compiled it as a frame of its own."""
    codes: set[Any] = set()
    todo = list(fns)
    while todo and len(codes) < limit:
        fn = todo.pop()
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType) or code in codes:
            continue
        if code.co_filename.startswith(own):
            continue
        glb = getattr(fn, "__globals__", {})
        cells = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
        stack = [code]
        while stack:
            c = stack.pop()
            codes.add(c)
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
            named = [glb.get(n) for n in c.co_names]
            todo += [f for f in named if isinstance(f, types.FunctionType)]
            for mod in {id(g): g for g in named if isinstance(g, types.ModuleType)}.values():
                # a helper module's functions used as attributes (helpers.step(...))
                todo += [
                    f
                    for n in c.co_names
                    if isinstance(f := vars(mod).get(n), types.FunctionType)  # no lazy import
                ]
        todo += [f for f in cells if isinstance(f, types.FunctionType)]
    return codes


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


_regions: weakref.WeakKeyDictionary[nn.Module, Region] = weakref.WeakKeyDictionary()
_region_of: weakref.WeakKeyDictionary[nn.Module, Region] = weakref.WeakKeyDictionary()


def compiled_regions(model: nn.Module) -> list[Region]:
    """Index the compiled regions of ``model`` (so hooks on their modules get routed); return them."""
    found: list[Region] = []
    for raw_name, module in model.named_modules():
        in_place = getattr(module, "_compiled_call_impl", None) is not None
        if not (is_optimized(module) or in_place):
            continue
        region = _regions.get(module)
        if region is None:
            region = Region(module, clean_name(raw_name))
            if region.ctx is None:
                raise UnsupportedModelError(
                    f"layer {region.name or '<root>'!r} is compiled in a form hookscope does not "
                    "know (no Dynamo context found), so hooks on it would be ignored; attach "
                    "hookscope to the model before compiling it, or compile with torch.compile(model)"
                )
            _regions[module] = region
        found.append(region)
    # pre-order: the outermost region routes everything inside it; a compiled part nested in it
    # is traced into by the outer variant (Dynamo inlines nested compiled code)
    mapping: dict[nn.Module, Region] = {}
    for region in found:
        for sub in region.root.modules():
            mapping.setdefault(sub, region)
    for sub, region in mapping.items():
        _region_of[sub] = region
    # a forward compiled as a function (module.forward = torch.compile(module.forward)): no
    # region hookscope can route, so hooks on the modules it calls are refused when placed
    for raw_name, module in model.named_modules():
        fn = module.__dict__.get("forward")
        if (
            getattr(fn, "_torchdynamo_orig_callable", None) is None
            or is_optimized(module)  # (the wrapper's own forward: a region, routed)
            or region_of(module) is not None
        ):
            continue
        for sub in module.modules():
            if sub is not module:
                _forward_compiled[sub] = (clean_name(raw_name), weakref.ref(module))
    return found


# module -> (the name of the module whose forward, compiled as a function, calls it; that module)
_forward_compiled: weakref.WeakKeyDictionary[nn.Module, tuple[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def check_not_in_compiled_forward(module: nn.Module, layer: str) -> None:
    """Refuse a hook on a module called by a forward compiled as a function: that compiled code
    traces the hook at compile time instead of running it (its rows, its values: silently
    missing)."""
    got = _forward_compiled.get(module) if _forward_compiled else None
    if got is None:
        return
    owner, ref = got
    fn = ref().__dict__.get("forward") if ref() is not None else None
    if getattr(fn, "_torchdynamo_orig_callable", None) is None:  # set back since
        return
    raise UnsupportedModelError(
        f"layer {layer!r} is called by {owner or '<root>'!r}, whose forward was compiled as a "
        f"function ({owner or 'model'}.forward = torch.compile(...)): that compiled code does not "
        "run hooks added to the modules it calls; compile the module instead "
        f"(torch.compile({owner or 'model'}) or {owner or 'model'}.compile()), which hookscope "
        "routes"
    )


def region_of(module: nn.Module) -> Region | None:
    """The compiled region ``module`` runs in (indexed by :func:`compiled_regions`), or None."""
    if not _region_of:
        return None
    return _region_of.get(module)


class GenerateGuard:
    """transformers' ``generate()`` compiling the model's ``__call__`` by itself: never silent.

    For a compilable cache (a static cache) on a GPU, or on any device with
    ``compile_config._compile_all_devices``, ``generate()`` runs its decode steps through
    ``model.get_compiled_call(...)``, a ``torch.compile`` of the bound ``__call__`` that
    hookscope was not given: Dynamo does not guard on hooks (``skip_nnmodule_hook_guards``), so
    hooks added after that code was compiled would silently not run in those steps. While a scope
    holds hooks on modules of such a model, its ``get_compiled_call`` returns the eager
    ``__call__`` instead: every step sees the hooks (exact values, eager speed), with one
    :class:`HookscopeWarning` per scope naming the layers and how to stay compiled.
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)
        self.layers: Counter[str] = Counter()
        self._warned = False

    def acquire(self, layer: str) -> Callable[[], None]:
        """Count one hook on a module of the model; return its (idempotent) release."""
        root = self._root()
        if root is None:
            return lambda: None
        if not self.layers:
            root.__dict__["get_compiled_call"] = _EagerCall(self)
        return _hold(self.layers, layer, self._release_all)

    def _release_all(self) -> None:
        owner = self._root()
        if owner is not None:
            owner.__dict__.pop("get_compiled_call", None)
        self._warned = False

    def _eager_call(self) -> Callable[..., Any]:
        root = self._root()
        assert root is not None
        if not self._warned:
            self._warned = True
            # the layers asked for (a root hook of hookscope's own is named only if alone)
            names = ", ".join(repr(n) for n in sorted(n for n in self.layers if n)) or "'<root>'"
            warnings.warn(
                f"generate() compiles {type(root).__name__}'s forward by itself here (a static "
                f"cache), and that compiled code would skip the hooks on layers {names}: while "
                "they are on, hookscope runs those decode steps eagerly (exact values, eager "
                "speed). To keep them compiled, compile the model with model.compile() (hookscope "
                "routes its hooks) and pass disable_compile=True to generate()",
                HookscopeWarning,
                stacklevel=4,
            )
        return root.__call__


class _EagerCall:
    """The model's ``get_compiled_call`` while hooks are on it. A deep copy of the model gets the
    class's own method back (the copy holds no hooks of the scope)."""

    def __init__(self, guard: GenerateGuard) -> None:
        self._guard = guard

    def __call__(self, compile_config: Any = None) -> Callable[..., Any]:
        return self._guard._eager_call()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        root = self._guard._root()
        twin = memo.get(id(root))
        if twin is None:
            return self
        return types.MethodType(type(root).get_compiled_call, twin)

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickle of the model (torch.save(model)) gets the class's own method: the copy holds
        # no hooks of the scope
        return (getattr, (self._guard._root(), "get_compiled_call"))


_generate_guards: weakref.WeakKeyDictionary[nn.Module, GenerateGuard] = weakref.WeakKeyDictionary()


def index_generate(model: nn.Module) -> None:
    """Map the modules of a model whose ``generate()`` may compile it by itself (a transformers
    ``GenerationMixin``: it has ``get_compiled_call``) to its :class:`GenerateGuard`."""
    if not callable(getattr(type(model), "get_compiled_call", None)):
        return
    guard = _generate_guards.get(model)
    if guard is None or guard._root() is not model:
        guard = GenerateGuard(model)
        for sub in model.modules():
            _generate_guards[sub] = guard


def routing() -> bool:
    """Whether any module is indexed in a compiled region or a generating model (else
    :func:`region_of` and :func:`generate_guard` are None for every module: hot loops skip them),
    or is called by a forward compiled as a function."""
    return bool(_region_of) or bool(_generate_guards) or bool(_forward_compiled)


def generate_guard(module: nn.Module) -> GenerateGuard | None:
    """The :class:`GenerateGuard` of the generating model ``module`` belongs to, or None."""
    if not _generate_guards:
        return None
    return _generate_guards.get(module)
