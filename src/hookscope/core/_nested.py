"""Walking nested values: tensors inside tuples, lists, dicts, dataclasses and ``ModelOutput``.

Model outputs are rarely a bare tensor: LSTMs return ``(out, (h, c))``, detection models return
lists of dicts, HuggingFace models return ``ModelOutput`` (an ordered dict that is also a
dataclass). Every hookscope feature walks them through the two functions here, so a new container
type is supported everywhere at once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from ._errors import HookscopeWarning

__all__ = [
    "SCALARS",
    "Shapes",
    "call_shapes",
    "continuous",
    "describe",
    "describe_call",
    "first_tensor",
    "format_shapes",
    "hidden_tensors",
    "iter_tensors",
    "map_tensors",
    "object_copier",
    "real_parts",
    "replace_first",
    "shapes",
    "tensors_of",
]

Path = tuple[Any, ...]
# The one form of shapes that trace, summary (rows, tables, JSON) and TraceEvent use: one tensor's
# shape as a list of ints; several tensors (a nested value, or a call's inputs) as
# ``{dotted path: shape}``.
Shapes = list[int] | dict[str, list[int]]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


# leaves that are never containers: the walks below return at once for them (an ABC check of
# ``Mapping`` and a dataclass check per leaf are most of a walk's cost on a layer's arguments)
SCALARS = frozenset({type(None), int, float, bool, str, bytes, complex, torch.dtype, torch.device})
_ATOMS = SCALARS


def iter_tensors(obj: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside ``obj``, depth first, in order.

    >>> x = torch.zeros(2)
    >>> [p for p, _ in iter_tensors({"a": x, "b": (x, None, 3)})]
    [('a',), ('b', 0)]
    """
    cls = obj.__class__
    if cls in _ATOMS:
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, (*path, i))
    elif cls is dict or isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, (*path, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), (*path, f.name))


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in :func:`iter_tensors`'s order, without their paths (a hot
    hook's way: no generator per container).

    >>> x = torch.zeros(2)
    >>> len(tensors_of({"a": x, "b": (x, None, 3)}))
    2
    """
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    cls = obj.__class__
    if cls is torch.Tensor:
        out.append(obj)
    elif cls in _ATOMS:
        return
    elif cls is tuple or cls is list:
        for v in obj:
            if v.__class__ is torch.Tensor:
                out.append(v)
            else:
                _collect(v, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _collect(v, out)
    elif cls is dict or isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), out)


def map_tensors(
    fn: Callable[[torch.Tensor], Any], obj: Any, other: Callable[[Any], Any] | None = None
) -> Any:
    """Return ``obj`` rebuilt with ``fn`` applied to every tensor; other leaves are kept as is.

    Containers keep their type (namedtuples, ``OrderedDict``, ``ModelOutput``, dataclasses).
    ``other``, if given, maps the non-tensor leaves (e.g. ``lambda _: None``).

    >>> map_tensors(lambda t: t + 1, (torch.zeros(1), "keep"))
    (tensor([1.]), 'keep')
    """
    cls = obj.__class__
    if cls is torch.Tensor:
        return fn(obj)
    if cls in _ATOMS:
        return obj if other is None or obj is None else other(obj)
    if cls is tuple:
        return tuple([map_tensors(fn, v, other) for v in obj])
    if cls is dict:  # a plain dict: a new one, the same keys in the same order
        return {k: map_tensors(fn, v, other) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(fn, v, other) for v in obj]
    if isinstance(obj, tuple):
        vals = [map_tensors(fn, v, other) for v in obj]
        return type(obj)(*vals) if _is_namedtuple(obj) else type(obj)(vals)
    if isinstance(obj, Mapping):
        return _rebuilt_mapping(obj, {k: map_tensors(fn, v, other) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, map_tensors(fn, getattr(obj, f.name), other))
        return out
    return obj if other is None or obj is None else other(obj)


def _rebuilt_mapping(obj: Mapping[Any, Any], new: dict[Any, Any]) -> Any:
    """``obj``'s type holding ``new``'s values, ``obj`` itself unchanged.

    A shallow copy written to, where that leaves ``obj`` as it was: a mapping keeping its items
    in a container of its own (``self._d``) shares that container with its shallow copy, so its
    containers are copied too; else its class called on the items (``MappingProxyType``, a
    read-only mapping). Where none gives ``obj``'s type with exactly those items, a plain dict
    with a warning naming the class: code that checks the type would read another value."""
    old = dict(obj.items())
    # (a mapping making its items on each read cannot be checked by identity: copy, write)
    stable = all(obj[k] is v for k, v in old.items())

    def holds(out: Any) -> bool:
        return type(out) is type(obj) and (
            not stable
            or (
                list(out.keys()) == list(new)
                and all(out[k] is v for k, v in new.items())
                and all(obj[k] is v for k, v in old.items())
            )
        )

    def put_back() -> None:  # a write that reached obj's own storage is undone
        if stable:
            with contextlib.suppress(Exception):
                for k, v in old.items():
                    if obj[k] is not v:
                        obj[k] = v  # type: ignore[index]

    for deeper in (False, True):
        try:
            out = copy.copy(obj)
            state = getattr(out, "__dict__", None)
            if deeper and isinstance(state, dict):
                for a, v in list(state.items()):
                    if v.__class__ in (dict, list) or isinstance(v, Mapping):
                        state[a] = copy.copy(v)
            for k, v in new.items():
                out[k] = v  # type: ignore[index]
        except Exception:
            put_back()
            continue
        if holds(out):
            return out
        put_back()
    with contextlib.suppress(Exception):
        out = type(obj)(new)  # type: ignore[call-arg]
        if holds(out):
            return out
    warnings.warn(
        f"hookscope: a {type(obj).__name__} among a layer's values could not be rebuilt with "
        "new values without changing it (no copy of it can be written to): a plain dict with "
        f"the same items stands for it; code that checks for a {type(obj).__name__} reads "
        "another value. Return a dict, a ModelOutput or a dataclass from the layer",
        HookscopeWarning,
        stacklevel=3,
    )
    return new


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor inside ``obj`` (the main output of most layers), or ``None``."""
    if isinstance(obj, torch.Tensor):
        return obj
    for _, t in iter_tensors(obj):
        return t
    return None


def replace_first(obj: Any, new: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt with its first tensor replaced by ``new`` (or by ``new(first)`` when ``new``
    is callable); every other leaf kept, containers keep their type (namedtuples, dataclasses,
    ``ModelOutput``). Only the first occurrence is replaced, even when the same tensor object
    appears again later (``(h, h)``). A hook changing "the layer's main output" uses this.

    >>> from collections import namedtuple
    >>> Out = namedtuple("Out", "hidden attn")
    >>> h = torch.zeros(2)
    >>> replace_first(Out(h, h), lambda t: t + 1)
    Out(hidden=tensor([1., 1.]), attn=tensor([0., 0.]))
    >>> replace_first(h, torch.ones(1))
    tensor([1.])
    """
    fn = new if callable(new) else (lambda _t: new)
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    done = False

    def swap(t: torch.Tensor) -> torch.Tensor:
        nonlocal done
        if done:
            return t
        done = True
        return fn(t)

    return map_tensors(swap, obj)


def describe(obj: Any) -> str:
    """A short human description of a nested value's shapes, e.g. ``(2, 3) | (h: (1, 2, 4))``."""
    if isinstance(obj, torch.Tensor):
        return str(tuple(obj.shape))
    parts = []
    for path, t in iter_tensors(obj):
        key = ".".join(str(p) for p in path)
        parts.append(f"{key}: {tuple(t.shape)}" if key else str(tuple(t.shape)))
    return ", ".join(parts) if parts else type(obj).__name__


def describe_call(args: Any, kwargs: Any = None) -> str:
    """Shapes of a call's inputs: ``(8, 3, 32, 32)``, or ``(8, 16), mask=(8, 16)`` for several."""
    parts = [
        describe(a)
        for a in args
        if first_tensor(a) is not None or not isinstance(a, (int, float, type(None)))
    ]
    parts += [
        f"{k}={describe(v)}" for k, v in (kwargs or {}).items() if first_tensor(v) is not None
    ]
    return ", ".join(parts) if parts else "no tensor inputs"


def _key(path: Path) -> str:
    return ".".join(str(p) for p in path)


def shapes(obj: Any) -> Shapes:
    """The shapes of a value in hookscope's one form: a tensor gives its shape as a list; a nested
    value gives ``{dotted path: shape}`` (``"0"``, ``"logits"``, ``"hidden_states.2"``), ``{}``
    when it holds no tensor.

    >>> shapes(torch.zeros(2, 3)), shapes((torch.zeros(2), {"h": torch.zeros(1, 4)}))
    ([2, 3], {'0': [2], '1.h': [1, 4]})
    """
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    return {_key(p): list(t.shape) for p, t in iter_tensors(obj)}


def call_shapes(args: Any, kwargs: Any = None) -> Shapes:
    """The shapes of a call's inputs in the same form: one positional tensor and no keyword
    tensor gives its shape; otherwise ``{path: shape}`` with positional paths (``"0"``,
    ``"1.h"``) and keyword names (``"attention_mask"``).

    >>> call_shapes((torch.zeros(2, 3),)), call_shapes((torch.zeros(2),), {"mask": torch.zeros(2)})
    ([2, 3], {'0': [2], 'mask': [2]})
    """
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        return list(args[0].shape)
    out = {_key((i, *p)): list(t.shape) for i, a in enumerate(args) for p, t in iter_tensors(a)}
    out.update(
        {
            _key((k, *p)): list(t.shape)
            for k, v in (kwargs or {}).items()
            for p, t in iter_tensors(v)
        }
    )
    return out


def format_shapes(s: Shapes) -> str:
    """The text of :func:`shapes` / :func:`call_shapes`, as trace and summary print it:
    ``[2, 3]``, or ``0:[2], mask:[2]`` for several tensors, ``-`` for none.

    >>> format_shapes([2, 3]), format_shapes({"0": [2], "mask": [2]}), format_shapes({})
    ('[2, 3]', '0:[2], mask:[2]', '-')
    """
    if isinstance(s, list):
        return "[" + ", ".join(map(str, s)) + "]"
    return ", ".join(f"{k}:[{', '.join(map(str, v))}]" for k, v in s.items()) or "-"


class _Uncopyable(Exception):
    pass


def object_copier(
    tensor: Callable[[torch.Tensor], Any] | None = None,
    where: str = "",
    who: str = "hs.compare",
) -> Callable[[Any], Any]:
    """``other`` for :func:`~hookscope.core._nested.map_tensors`: each object among a value that
    is no tensor, number or string (a cache passed to a call) copied, so that a forward growing
    it changes neither the value kept of it nor the kept value a replay hands a module. Objects
    are copied through their attributes, containers item by item, each tensor inside by
    ``tensor`` (default: a detached clone; autograd's non-leaf tensors cannot be deep-copied);
    the same object twice in one value stays one copy. Modules, classes and functions are kept
    as they are; an object that cannot be copied is kept too, with a warning naming ``where``
    (``who``: the product saying it).

    >>> class Box:
    ...     def __init__(self, h): self.h = h
    >>> box = Box(torch.zeros(1))
    >>> kept = map_tensors(lambda t: t.clone(), (box,), object_copier())
    >>> box.h = torch.ones(1)
    >>> kept[0].h.tolist(), kept[0] is box
    ([0.0], False)
    """
    memo: dict[int, Any] = {}
    fn = tensor or (lambda t: t.detach().clone())

    def walk(obj: Any, depth: int) -> Any:
        cls = obj.__class__
        if cls in SCALARS:
            return obj
        got = memo.get(id(obj))
        if got is not None:
            return got
        if isinstance(obj, torch.Tensor):
            new: Any = fn(obj)
        elif isinstance(obj, (nn.Module, type)) or callable(obj):
            return obj
        elif depth == 0:
            raise _Uncopyable(cls.__name__)
        elif cls in (list, tuple):
            new = cls(walk(v, depth - 1) for v in obj)
        elif cls is dict:
            new = {k: walk(v, depth - 1) for k, v in obj.items()}
        elif isinstance(getattr(obj, "__dict__", None), dict):
            try:
                new = copy.copy(obj)
            except Exception:
                raise _Uncopyable(cls.__name__) from None
            if new is obj:  # immutable by its own account (an enum member)
                return obj
            memo[id(obj)] = new
            for k, v in obj.__dict__.items():
                new.__dict__[k] = walk(v, depth - 1)
        else:
            try:
                new = copy.deepcopy(obj)
            except Exception:
                raise _Uncopyable(cls.__name__) from None
        memo[id(obj)] = new
        return new

    def copy_object(obj: Any) -> Any:
        if obj.__class__ in SCALARS:
            return obj
        try:
            return walk(obj, 12)
        except _Uncopyable as exc:
            warnings.warn(
                f"{who}: cannot copy a {type(obj).__name__} among the values of "
                f"{where or 'a module call'} (it holds a {exc}); it is kept as it is, so a "
                "forward that changes it changes the recorded value too",
                HookscopeWarning,
                stacklevel=2,
            )
            return obj

    return copy_object


def hidden_tensors(value: Any, depth: int = 12) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors held inside the objects among ``value`` (attributes of an instance that is
    no tuple, list, dict or dataclass: a ``Box(h)`` a module returns, a cache), in attribute
    order, and the classes of the outermost such objects: what the nested walk
    (:func:`~hookscope.core._nested.tensors_of`) does not enter. Modules, classes and functions
    are not entered; an object met twice counts once.

    >>> class Box:
    ...     def __init__(self, h): self.h = h
    >>> ts, classes = hidden_tensors((torch.zeros(1), Box(torch.ones(2))))
    >>> [t.tolist() for t in ts], classes
    ([[1.0, 1.0]], ['Box'])
    """
    found: list[torch.Tensor] = []
    classes: list[str] = []
    seen: set[int] = set()

    def walk(obj: Any, left: int, inside: bool) -> None:
        cls = obj.__class__
        if cls in SCALARS or left < 0:
            return
        if isinstance(obj, torch.Tensor):
            if inside:
                found.append(obj)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, left - 1, inside)
        elif isinstance(obj, Mapping):
            for v in obj.values():
                walk(v, left - 1, inside)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name, None), left - 1, inside)
        elif isinstance(obj, (nn.Module, type)) or callable(obj):
            return
        else:
            attrs = getattr(obj, "__dict__", None)
            values = list(attrs.values()) if isinstance(attrs, dict) else []
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    values.append(getattr(obj, slot))
            n = len(found)
            for v in values:
                walk(v, left - 1, True)
            if len(found) > n and not inside:
                classes.append(cls.__name__)

    walk(value, depth, False)
    return found, classes


def continuous(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values compared by their size and carrying gradients: floating or
    complex (an FFT layer's output, a rotary table kept as ``complex64``); other dtypes (ids,
    masks, indices) are exact.

    >>> continuous(torch.zeros(2, dtype=torch.complex64)), continuous(torch.zeros(2, dtype=torch.int64))
    (True, False)
    """
    return t.is_floating_point() or t.is_complex()


def real_parts(t: torch.Tensor) -> torch.Tensor:
    """A complex ``t`` as its real and imaginary parts (``view_as_real``, a view: its norm and
    extremes are the complex values'; reductions such as ``aminmax`` take no complex tensor); a
    real one as it is.

    >>> real_parts(torch.tensor([1 + 2j])).tolist()
    [[1.0, 2.0]]
    """
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
