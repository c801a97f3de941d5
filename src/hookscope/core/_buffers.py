"""Put a model's state back as it was after a forward that must leave no trace.

Buffers (:func:`buffers_kept`): a forward can change one in two ways: in place (BatchNorm's
running statistics in train mode, which some kernels update without bumping the tensor's
version) or by reassigning it (``self.steps = self.steps + 1`` replaces the tensor in the
module's ``_buffers``, a cache is re-registered at another length). Both are undone, and a
buffer the forward added is removed. A buffer of another layout (a sparse adjacency matrix, a
nested or quantized tensor) is compared by its parts (:func:`same_tensor`: ``torch.equal`` has no
sparse kernel) and put back with ``copy_``.

Plain attributes (:class:`Attributes`, :func:`state_kept`): numbers, strings, None and tensors
held as attributes of a module (a step counter ``self.calls += 1``, a tensor cached as a plain
attribute), and the contents of the lists, dicts, sets and deques its attributes hold (a list of
attention maps appended to). A product that runs a model a second time (a replay, a map, a
profile) keeps them, or the second run starts from the state the first one left (a counter one
higher: silently other values) and the user's model is left changed.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from ._compiled import named_parameters
from ._errors import HookscopeWarning

__all__ = [
    "INTERNALS",
    "SPARSE_PARTS",
    "Attributes",
    "Containers",
    "ParamVersions",
    "buffers_kept",
    "plain_attributes",
    "same_tensor",
    "state_kept",
    "version_of",
]

# nn.Module's own bookkeeping (parameters, buffers, hooks...): never put back
INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_SCALARS = (bool, int, float, str)


def plain_attributes(d: dict[str, Any]) -> dict[str, Any]:
    """A module's plain attributes: numbers, strings, None and tensors (not its parameters,
    buffers, submodules, hooks or any other object)."""
    kinds = _KINDS
    return {
        k: v
        for k, v in d.items()
        if (kinds.get(type(v)) or _kind(type(v))) <= _TENSOR and k not in INTERNALS
    }


# what a value is to the state kept, by its type (cached per class: isinstance on an object whose
# class overrides __getattribute__, a Transformers config, calls it for __class__ each time)
_PLAIN, _TENSOR, _DICT, _SEQ, _TUPLE, _CONFIG, _OTHER = range(1, 8)
_KINDS: dict[type, int] = {
    type(None): _PLAIN,
    bool: _PLAIN,
    int: _PLAIN,
    float: _PLAIN,
    str: _PLAIN,
}


def _kind(cls: type) -> int:
    """The kind of values of class ``cls`` (see ``_KINDS``), computed once per class."""
    if issubclass(cls, torch.Tensor):
        kind = _TENSOR
    elif issubclass(cls, dict):
        kind = _DICT
    elif issubclass(cls, (list, collections.deque, set)):
        kind = _SEQ
    elif issubclass(cls, tuple):
        kind = _TUPLE
    elif _is_config(cls):
        kind = _CONFIG
    else:
        kind = _OTHER
    _KINDS[cls] = kind
    return kind


class Containers:
    """The contents of the Python containers (lists, dicts, sets, deques, and those nested in
    them or in tuples) held by the attributes of ``modules``, to put back in the same objects.

    A container's contents are copied shallowly (the objects in it are shared); a container
    reached twice is kept once.

    >>> m = torch.nn.Linear(2, 2)
    >>> m.maps = [1]
    >>> kept = Containers([m])
    >>> m.maps.append(2)
    >>> kept.restore()
    >>> m.maps
    [1]
    """

    _DEPTH = 8  # nesting followed at most

    def __init__(self, modules: Any) -> None:
        self.saved: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for m in modules:
            for k, v in m.__dict__.items():
                if k not in INTERNALS:
                    self._walk(v, seen, 0)

    def _walk(self, obj: Any, seen: set[int], depth: int) -> None:
        cls = type(obj)
        kind = _KINDS.get(cls) or _kind(cls)
        if kind < _DICT or kind > _TUPLE or depth > self._DEPTH or id(obj) in seen:
            return
        if kind == _DICT:
            items: Any = list(dict.items(obj))
            inner: Any = [v for _, v in items]
        elif kind == _SEQ:
            items = inner = list(obj)
        else:
            items, inner = None, obj  # a tuple, immutable: only what it holds may change
        seen.add(id(obj))
        if items is not None:
            self.saved.append((obj, items))
        for v in inner:
            self._walk(v, seen, depth + 1)

    def restore(self) -> None:
        """Put every container's contents back (its own methods bypassed: a subclass that
        counts or validates its writes sees nothing)."""
        for obj, items in self.saved:
            if isinstance(obj, dict):
                now = list(dict.items(obj))
                if len(now) != len(items) or any(
                    a[0] is not b[0] or a[1] is not b[1] for a, b in zip(now, items)
                ):
                    dict.clear(obj)
                    dict.update(obj, items)
            elif isinstance(obj, list):
                if len(obj) != len(items) or any(a is not b for a, b in zip(obj, items)):
                    list.__setitem__(obj, slice(None), items)
            elif isinstance(obj, collections.deque):
                collections.deque.clear(obj)
                collections.deque.extend(obj, items)
            else:
                set.clear(obj)
                set.update(obj, items)


class Attributes:
    """The plain attributes of every module of ``model`` (:func:`plain_attributes`: a step
    counter, a tensor cached as an attribute) and the contents of the containers its attributes
    hold (:class:`Containers`), to put back with :meth:`restore`.

    Modules of PyTorch's own classes are left out (a wrapper's bookkeeping, FSDP's or DDP's, is
    not the model's state). A configuration object the modules hold (a class named ``*Config``,
    such as Transformers' ``PretrainedConfig``, whose forward sets ``problem_type`` from the first
    labels it sees) has its plain values put back too. A tensor attribute is kept by value too (a forward may change it in
    place). A public attribute holding any other object (a list, a helper) that the forward
    reassigned gets its object back. A plain attribute
    the forward added is removed on restore, unless its name starts with ``_``: a class's own
    bookkeeping that records state the restore does not undo (Transformers'
    ``_output_capturing_hooks_installed`` marks hooks it installed on the first forward that
    asked for hidden states: removing the mark would install them twice).

    Example:
        >>> import torch.nn as nn
        >>> class Mine(nn.Linear):  # (PyTorch's own classes are left alone)
        ...     pass
        >>> m = Mine(2, 2)
        >>> m.calls, m.maps = 0, []
        >>> kept = Attributes(m)
        >>> m.calls += 1; m.maps.append(1); m.extra = 1.0
        >>> kept.restore()
        >>> m.calls, m.maps, hasattr(m, "extra")
        (0, [], False)
    """

    def __init__(self, model: nn.Module) -> None:
        # PyTorch's own classes are left alone: their forward keeps no plain state of the
        # model's (their state is buffers), and a wrapper's bookkeeping (FSDP's handles and
        # streams, DDP's sync flags) must not be rolled back under it (a crash, not a restore)
        modules = [m for m in model.modules() if _own(type(m))]
        # one pass over each module's attributes: its plain ones, the containers they hold (a
        # list of maps it appends to), and a configuration object it holds (Transformers'
        # PretrainedConfig: its forward sets config.problem_type from the first labels it
        # sees): the config's plain values, once each
        # (module, its plain attributes, the names its __dict__ had: a name added since is
        # looked at on restore, the common case of none added costs one set comparison)
        self.attrs: list[tuple[nn.Module, dict[str, Any], frozenset[str]]] = []
        # (module, its public attributes holding other objects): put back by identity where the
        # forward reassigned them (``self.maps = []``, ``self.helper = 1.5``)
        self.objects: list[tuple[nn.Module, dict[str, Any]]] = []
        self.containers = containers = Containers(())
        self.configs: dict[int, tuple[Any, dict[str, Any]]] = {}
        seen: set[int] = set()
        kinds = _KINDS
        for m in modules:
            plain = {}
            objects = {}
            d = m.__dict__
            for k, v in d.items():
                if k in INTERNALS:
                    continue
                kind = kinds.get(type(v)) or _kind(type(v))
                if kind <= _TENSOR:
                    plain[k] = v
                    continue
                if k[:1] != "_":
                    objects[k] = v
                if kind == _OTHER:
                    continue
                if kind == _CONFIG:
                    if id(v) not in self.configs:
                        cd = object.__getattribute__(v, "__dict__")
                        self.configs[id(v)] = (v, plain_attributes(cd))
                else:
                    containers._walk(v, seen, 0)
            self.attrs.append((m, plain, frozenset(d)))
            if objects:
                self.objects.append((m, objects))
        # what each module holds besides: a forward that registers a parameter, a buffer or a
        # submodule, or materializes a lazy parameter, built the module; its plain attributes
        # then describe the built module (in_features), and putting them back would undo half
        self.built = [(m, _held(m)) for m in modules]
        # tensor attributes (not buffers) a forward may change in place: their values, put back
        self.values = [
            (v, v._version, v.detach().clone())
            for _, before, _ in self.attrs
            for v in before.values()
            if isinstance(v, torch.Tensor) and not v.is_meta
        ]

    def restore(self) -> None:
        built = {id(m) for m, held in self.built if not _holds(m, held)}
        kinds = _KINDS
        for m, before, names in self.attrs:
            if built and id(m) in built:
                continue
            d = m.__dict__
            if d.keys() != names:  # names added (or removed) since: the plain ones added go
                for k in d.keys() - names:
                    v = d[k]
                    if (
                        not k.startswith("_")
                        and k not in INTERNALS
                        and (kinds.get(type(v)) or _kind(type(v))) <= _TENSOR
                    ):
                        del d[k]
            for k, v in before.items():
                if d.get(k, _ABSENT) is not v:
                    d[k] = v
        for m, objects in self.objects:
            if built and id(m) in built:
                continue
            d = m.__dict__
            for k, v in objects.items():
                if d.get(k, _ABSENT) is not v:
                    d[k] = v
        self.containers.restore()
        for obj, before in self.configs.values():
            d = object.__getattribute__(obj, "__dict__")
            for k, v in before.items():
                if d.get(k, _ABSENT) is not v:
                    d[k] = v
        for v, version, value in self.values:
            if v._version != version:
                with torch.no_grad():
                    v.copy_(value)


_ABSENT = object()


def version_of(t: torch.Tensor) -> int | None:
    """``t._version`` (``None`` for a tensor without one: an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


_CONFIG_TYPES: dict[type, bool] = {}


def _is_config(cls: type) -> bool:
    """Whether instances of ``cls`` are configuration objects (a class named ``*Config`` in
    its MRO, with a ``__dict__``), cached per class."""
    got = _CONFIG_TYPES.get(cls)
    if got is None:
        got = _CONFIG_TYPES[cls] = (
            cls not in (int, float, str, bool, type(None), list, dict, tuple)
            and not issubclass(cls, (torch.Tensor, nn.Module))
            and any(c.__name__.endswith("Config") for c in cls.__mro__)
            and "__dict__" in dir(cls)
        )
    return got


_OWN: dict[type, bool] = {}


def _own(cls: type) -> bool:
    """:func:`_own_class`, cached."""
    got = _OWN.get(cls)
    return _own_class(cls) if got is None else got


def _own_class(cls: type) -> bool:
    """Whether a module class is not entirely PyTorch's own: a class of the model's, or one
    PyTorch made from it (``torch.nn.utils.parametrize``'s ``Parametrized<Class>``, FSDP2's
    ``FSDP<Class>`` keep the user's class in their MRO); cached per class (``_OWN``)."""
    own = _OWN[cls] = any(
        c is not object and not c.__module__.startswith(("torch.", "torch"))
        for c in cls.__mro__
        if c.__module__ != "builtins"
    )
    return own


def _held(m: nn.Module) -> tuple[Any, ...]:
    """What ``m`` holds: its parameters, buffers and submodules (names and objects), and the
    class of each parameter (a lazy one materialized changes class in place); compared with
    :func:`_holds`, by identity."""
    params = m._parameters
    return (
        list(params.items()),
        [v.__class__ for v in params.values()],
        list(m._buffers.items()),
        list(m._modules.items()),
    )


def _holds(m: nn.Module, held: tuple[Any, ...]) -> bool:
    """Whether ``m`` still holds what :func:`_held` saw: the same names, the same objects (by
    identity: a tensor is never compared by value), the same parameter classes."""
    params, classes, buffers, modules = held
    for now, then in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
        if len(now) != len(then):
            return False
        for (k, v), (k0, v0) in zip(now.items(), then):
            if v is not v0 or k != k0:
                return False
    return all(v.__class__ is c for v, c in zip(m._parameters.values(), classes))


@contextmanager
def state_kept(model: nn.Module) -> Iterator[ParamVersions]:
    """Restore every buffer (:func:`buffers_kept`) and plain attribute (:class:`Attributes`) of
    ``model`` on exit; the parameters changed in place meanwhile (not copied, so not restored)
    are named in a warning, and by the :class:`ParamVersions` it yields.

    Example:
        >>> import torch, torch.nn as nn
        >>> class Counts(nn.Linear):
        ...     calls = 0
        ...     def forward(self, x):
        ...         self.calls += 1
        ...         return super().forward(x) * self.calls
        >>> m = Counts(2, 2)
        >>> with state_kept(m):
        ...     _ = m(torch.ones(1, 2))
        >>> m.calls
        0
    """
    attributes = Attributes(model)
    versions = ParamVersions(model)
    try:
        with buffers_kept(model):
            yield versions
    finally:
        attributes.restore()
    # parameters are not copied (a second copy of the weights): one the forward changed in
    # place (weight clipping under no_grad) stays changed, said here
    moved = versions.moved()
    if moved:
        shown = ", ".join(repr(n) for n in moved[:4]) + (" ..." if len(moved) > 4 else "")
        warnings.warn(
            f"hookscope: the model's forward changed its own parameters in place ({shown}: a "
            "clamp_ for weight clipping, a normalisation written back under no_grad); buffers "
            "and attributes are put back as found, parameters are not copied: they are left as "
            "this run made them (move that update out of forward)",
            HookscopeWarning,
            stacklevel=3,
        )


class ParamVersions:
    """Each parameter's ``_version`` when made (those a forward builds, lazy ones, left out);
    :meth:`moved` names the ones changed in place since (:func:`state_kept` yields one)."""

    def __init__(self, model: nn.Module) -> None:
        # the names are looked up only for a parameter that moved (rare): the model's walk of
        # named_parameters costs as much as the rest of a state kept
        self.model = model
        lazy = nn.parameter.UninitializedParameter
        self.versions = [
            (p, v)
            for p in model.parameters()
            if not isinstance(p, lazy) and (v := version_of(p)) is not None
        ]

    def moved(self) -> list[str]:
        moved = {id(p) for p, v in self.versions if version_of(p) != v}
        if not moved:
            return []
        names = {id(p): n for n, p in named_parameters(self.model)}
        return [names.get(id(p), "<a parameter no longer in the model>") for p, _ in self.versions
                if id(p) in moved]  # fmt: skip


# sparse layouts: the tensors holding their data (compressed indices, plain indices, values)
SPARSE_PARTS: dict[Any, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _plain(t: torch.Tensor) -> bool:
    """A strided dense tensor (``torch.equal``, ``set_`` and ``copy_`` all apply)."""
    return t.layout is torch.strided and not t.is_nested and not t.is_quantized


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values in the same form, for any layout: a sparse
    tensor by its indices and values (a COO one by its coalesced flag too), a strided nested one
    by its buffer and sizes, a wrapper subclass (a jagged nested tensor) by its inner tensors;
    ``False`` where they cannot be compared (then restoring copies anyway)."""
    if a.layout != b.layout or a.dtype != b.dtype or a.is_nested != b.is_nested:
        return False
    if _plain(a):
        return a.shape == b.shape and torch.equal(a, b)
    try:
        names = SPARSE_PARTS.get(a.layout)
        if names is not None:
            if a.shape != b.shape or (
                a.layout is torch.sparse_coo and a.is_coalesced() != b.is_coalesced()
            ):
                return False
            return all(same_tensor(getattr(a, n)(), getattr(b, n)()) for n in names)
        flatten = getattr(type(a), "__tensor_flatten__", None)
        if flatten is not None and type(a) is type(b):
            attrs = flatten(a)[0]
            return attrs == flatten(b)[0] and all(
                same_tensor(getattr(a, n), getattr(b, n)) for n in attrs
            )
        if a.is_nested:
            return torch.equal(a._nested_tensor_size(), b._nested_tensor_size()) and (
                torch.equal(a.values(), b.values())
            )
        return a.shape == b.shape and torch.equal(a, b)  # quantized, opaque layouts
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def _put_back(module: nn.Module, name: str, b: torch.Tensor, values: torch.Tensor) -> None:
    """Put ``values`` back into buffer ``b`` of another layout, in place; where that cannot be
    done (a nested buffer changed in size), the buffer's slot gets the saved copy, said."""
    try:
        b.copy_(values)
        if same_tensor(b, values):
            return
        why = "copy_ left other values"
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    module._buffers[name] = values
    warnings.warn(
        f"hookscope: the forward changed buffer {name!r} of a {type(module).__name__} (a "
        f"{values.layout} tensor) and it could not be put back in place ({why[:120]}); the "
        "buffer now holds a copy with its values from before the run, so a reference to the "
        "old tensor object kept outside the module sees the changed values",
        HookscopeWarning,
        stacklevel=4,
    )


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``model`` on exit: the same tensor object, with the same values.

    Example:
        >>> import torch, torch.nn as nn
        >>> bn = nn.BatchNorm1d(2)
        >>> with buffers_kept(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.num_batches_tracked.item(), bn.running_mean.tolist()
        (0, [0.0, 0.0])
    """
    modules = list(model.modules())
    names = [set(m._buffers) for m in modules]
    saved = [
        (module, name, b, None if b.is_meta else b.detach().clone())
        for module in modules
        for name, b in module._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        for module, had in zip(modules, names):
            for name in [n for n in module._buffers if n not in had]:
                del module._buffers[name]  # added in forward
        with torch.no_grad():
            for module, name, b, values in saved:
                if module._buffers.get(name) is not b:
                    module._buffers[name] = b  # reassigned in forward: put the original back
                if values is None:
                    continue
                if not _plain(b):  # sparse, nested, quantized: compared by their parts
                    if not same_tensor(b, values):
                        _put_back(module, name, b, values)
                elif b.shape != values.shape:  # resized in place
                    b.set_(values)
                elif not torch.equal(b, values):
                    b.copy_(values)
