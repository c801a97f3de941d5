"""Where the values of a recorded run live: in memory up to ``max_bytes``, on disk beyond (a
temporary folder removed with the store), or in a folder written by :func:`hookscope.record`.

Files are written with ``torch.save`` (tensors moved to the CPU) and read back with
``torch.load(weights_only=False)``: a record is a pickle, so load only records you trust.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from ..core._nested import iter_tensors, map_tensors

__all__ = ["ValueStore", "cpu_copy", "nbytes"]


def nbytes(value: Any) -> int:
    """Bytes of the tensors inside ``value``."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(value))


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor detached and copied to the CPU."""
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), value)


class ValueStore:
    """``put(key, value)`` / ``get(key)``; ``key`` a short string such as ``"out12"``.

    In memory until ``max_bytes`` (``None``: no bound) is reached, then in files of ``folder``
    (a temporary one when not given). A store over an existing record folder reads its files.
    """

    def __init__(self, max_bytes: int | None = None, folder: str | os.PathLike[str] | None = None):
        self.max_bytes = max_bytes
        self.mem: dict[str, Any] = {}
        self.bytes = 0
        self.spilled = 0
        self._folder = Path(folder) if folder is not None else None
        self._own = False

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="hookscope-compare-"))
            self._own = True
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder

    def put(self, key: str, value: Any) -> None:
        size = nbytes(value)
        if self.max_bytes is None or self.bytes + size <= self.max_bytes:
            self.mem[key] = value
            self.bytes += size
            return
        self.write(key, cpu_copy(value))
        self.spilled += size

    def write(self, key: str, value: Any) -> None:
        torch.save(value, self.folder() / f"{key}.pt")

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.mem:
            return self.mem[key]
        if self._folder is None:
            return default
        path = self._folder / f"{key}.pt"
        if not path.exists():
            return default
        return torch.load(path, map_location="cpu", weights_only=False)
