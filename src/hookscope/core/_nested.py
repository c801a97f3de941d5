"""Walking nested values: tensors inside tuples, lists, dicts, dataclasses and ``ModelOutput``.

Model outputs are rarely a bare tensor: LSTMs return ``(out, (h, c))``, detection models return
lists of dicts, HuggingFace models return ``ModelOutput`` (an ordered dict that is also a
dataclass). Every hookscope feature walks them through the two functions here, so a new container
type is supported everywhere at once.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["describe", "describe_call", "first_tensor", "iter_tensors", "map_tensors"]

Path = tuple[Any, ...]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def iter_tensors(obj: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside ``obj``, depth first, in order.

    >>> x = torch.zeros(2)
    >>> [p for p, _ in iter_tensors({"a": x, "b": (x, None, 3)})]
    [('a',), ('b', 0)]
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, (*path, i))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, (*path, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), (*path, f.name))


def map_tensors(
    fn: Callable[[torch.Tensor], Any], obj: Any, other: Callable[[Any], Any] | None = None
) -> Any:
    """Return ``obj`` rebuilt with ``fn`` applied to every tensor; other leaves are kept as is.

    Containers keep their type (namedtuples, ``OrderedDict``, ``ModelOutput``, dataclasses).
    ``other``, if given, maps the non-tensor leaves (e.g. ``lambda _: None``).

    >>> map_tensors(lambda t: t + 1, (torch.zeros(1), "keep"))
    (tensor([1.]), 'keep')
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(fn, v, other) for v in obj]
    if isinstance(obj, tuple):
        vals = [map_tensors(fn, v, other) for v in obj]
        return type(obj)(*vals) if _is_namedtuple(obj) else type(obj)(vals)
    if isinstance(obj, Mapping):
        new = {k: map_tensors(fn, v, other) for k, v in obj.items()}
        try:
            out = copy.copy(obj)
            for k, v in new.items():
                out[k] = v  # type: ignore[index]
            return out
        except Exception:  # an immutable or exotic mapping: fall back to a plain dict
            return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, map_tensors(fn, getattr(obj, f.name), other))
        return out
    return obj if other is None or obj is None else other(obj)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor inside ``obj`` (the main output of most layers), or ``None``."""
    if isinstance(obj, torch.Tensor):
        return obj
    for _, t in iter_tensors(obj):
        return t
    return None


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
