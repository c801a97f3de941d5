"""What an extraction read and how it pooled, as hashes: a resumed or repeated run is checked with them.

:func:`batch_digest` hashes the bytes the model reads from a batch (after the dataset's transform
and the collate function), so a resume on other data or another transform is caught;
:func:`callable_identity` describes a custom ``pool=`` function by its code and the values it
closes over, so that changing it changes the run's fingerprint. :func:`signature` describes one
sample's structure (``Tensor(3, 8, 8) float32``) for the messages about samples that cannot be
batched.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["batch_digest", "callable_identity", "hash_code", "model_inputs", "signature"]

_DEPTH = 4


def model_inputs(data: Any) -> Any:
    """The part of a collated batch the model is called with (see ``Runner._forward``)."""
    if isinstance(data, (tuple, list)) and not isinstance(data, torch.Tensor):
        return data[0] if data else data
    return data


def _update(h: Any, value: Any, depth: int = 0) -> None:
    """Feed ``value`` (tensors by their bytes, containers recursively) into the hash ``h``."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(f"A{a.shape}{a.dtype}".encode())
        if a.dtype.kind != "O":
            h.update(a.view(np.uint8).reshape(-1))
        else:
            for v in a.reshape(-1):
                _update(h, v, depth + 1)
    elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, Mapping):
        h.update(f"M{len(value)}".encode())
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _update(h, value[k], depth + 1)
    elif isinstance(value, (tuple, list)):
        h.update(f"S{len(value)}".encode())
        for v in value:
            _update(h, v, depth + 1)
    elif isinstance(value, torch.dtype):
        h.update(str(value).encode())
    elif callable(value) and depth < _DEPTH:
        _callable(h, value, depth + 1)
    else:  # an object we cannot read: its type only (its repr may hold its address)
        h.update(f"O{type(value).__module__}.{type(value).__qualname__}".encode())


def batch_digest(data: Any, indices: list[int], failed: list[int]) -> str:
    """A hash of the model's inputs in a collated batch (``None`` when every sample failed), its
    sample indices and which of them failed to load."""
    h = hashlib.sha256()
    h.update(repr((indices, failed)).encode())
    _update(h, None if data is None else model_inputs(data))
    return h.hexdigest()[:32]


def hash_code(h: Any, code: types.CodeType) -> None:
    """Feed a code object (its bytecode, names and constants, nested code included) into ``h``."""
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            hash_code(h, c)
        else:
            h.update(_const(c).encode())


def _names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the code nested in it (a lambda, a comprehension) read."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += [n for n in _names(c) if n not in names]
    return names


def _const(c: Any) -> str:
    """A constant's text, the same in every process (a frozenset's repr follows string hashing,
    which is randomized per process)."""
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const(v) for v in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const(v) for v in c) + ")"
    return repr(c)


def _callable(h: Any, fn: Any, depth: int) -> None:
    if isinstance(fn, functools.partial):
        h.update(b"partial")
        _callable(h, fn.func, depth + 1)
        _update(h, list(fn.args), depth + 1)
        _update(h, dict(fn.keywords), depth + 1)
        return
    if isinstance(fn, types.MethodType):
        _update(h, fn.__self__, depth + 1)
        fn = fn.__func__
    if isinstance(fn, torch.nn.Module):
        h.update(f"module:{type(fn).__module__}.{type(fn).__qualname__}".encode())
        for k, v in fn.state_dict().items():
            h.update(k.encode())
            _update(h, v, depth + 1)
        fn = type(fn).forward
    elif not isinstance(fn, types.FunctionType) and not isinstance(fn, types.BuiltinFunctionType):
        # a callable object: its class's __call__ and its attributes
        h.update(f"object:{type(fn).__module__}.{type(fn).__qualname__}".encode())
        _update(h, dict(getattr(fn, "__dict__", {})), depth + 1)
        fn = type(fn).__dict__.get("__call__") or type(fn).__call__
    if isinstance(fn, types.FunctionType):
        h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
        hash_code(h, fn.__code__)
        _update(h, fn.__defaults__, depth + 1)
        _update(h, fn.__kwdefaults__, depth + 1)
        for cell in fn.__closure__ or ():
            try:
                _update(h, cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                h.update(b"empty")
        # module-level values it reads (a constant, a tensor, an nn.Module with its weights, a
        # function with its code), not Python modules and classes
        for name in _names(fn.__code__):
            g = fn.__globals__.get(name)
            if isinstance(
                g,
                (
                    bool,
                    int,
                    float,
                    str,
                    torch.Tensor,
                    np.ndarray,
                    tuple,
                    list,
                    dict,
                    torch.nn.Module,
                ),
            ) or (isinstance(g, types.FunctionType) and depth < _DEPTH):
                h.update(name.encode())
                _update(h, g, depth + 1)
    elif fn is not None:
        h.update(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}".encode())


def callable_identity(fn: Callable[..., Any]) -> str:
    """A hash of a function's code, defaults, closure values and the module-level values it reads:
    changes when what it computes may change (the same function in a new process gives the same)."""
    h = hashlib.sha256()
    _callable(h, fn, 0)
    return h.hexdigest()[:32]


def signature(sample: Any, depth: int = 0) -> str:
    """One sample's structure, e.g. ``(Tensor(3, 8, 8) float32, int)``, for messages."""
    if isinstance(sample, torch.Tensor):
        return f"Tensor{tuple(sample.shape)} {str(sample.dtype).removeprefix('torch.')}"
    if isinstance(sample, np.ndarray):
        return f"ndarray{sample.shape} {sample.dtype}"
    if depth > _DEPTH:
        return "..."
    if isinstance(sample, Mapping):
        return "{" + ", ".join(f"{k!r}: {signature(v, depth + 1)}" for k, v in sample.items()) + "}"
    if isinstance(sample, (tuple, list)):
        inner = ", ".join(signature(v, depth + 1) for v in sample)
        return f"({inner})" if isinstance(sample, tuple) else f"[{inner}]"
    return "None" if sample is None else type(sample).__name__
