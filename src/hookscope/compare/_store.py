"""Where the values of a recorded run live: in memory up to ``max_bytes``, on disk beyond (a
temporary folder removed with the store), or in a folder written by :func:`hookscope.record`.

On disk, values are appended as they come to one file, ``values.bin`` (a :class:`Spool`): each
dense tensor's bytes as they are in memory, then the pickled structure that holds them (a tensor
is a reference to its bytes: offset, dtype, shape); ``Spool.index`` maps each key to its pickle.
One write per tensor, no archive per value: a tiny model's step writes hundreds of values, and a
``torch.save`` of each cost about 0.2 ms here. Tensors of other kinds (sparse, quantized,
subclasses) are pickled whole. Records of format 1 (one ``torch.save`` file per value) are read
by :class:`ValueStore` (``get``: ``<key>.pt``).

A record is a pickle: load only records you trust.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from ..core._nested import iter_tensors, map_tensors

__all__ = ["Spool", "SpoolReader", "ValueStore", "cpu_copy", "nbytes"]

SPOOL = "values.bin"


def nbytes(value: Any) -> int:
    """Bytes of the tensors inside ``value``."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(value))


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor detached and copied to the CPU."""
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), value)


def _raw(t: torch.Tensor) -> memoryview | None:
    """The bytes of a dense CPU tensor, as a buffer (no copy when contiguous); ``None`` for a
    tensor that must be pickled whole."""
    if t.__class__ is not torch.Tensor or t.layout is not torch.strided or t.is_quantized:
        return None
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    try:
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError):
        return None


class Spool:
    """Values appended to ``folder/values.bin`` as they come (one unbuffered write per tensor and
    one per value: on disk when :meth:`write` returns); ``index[key] = (offset, length)`` of each
    value's pickle. :meth:`close` ends it (a new ``Spool`` on the same folder starts a new file)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / SPOOL
        self.index: dict[str, tuple[int, int]] = {}
        self._f: Any = None
        self._at = 0

    def write(self, key: str, value: Any) -> None:
        if self._f is None:
            self._f = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        f = self._f

        def reference(obj: Any) -> Any:
            if not isinstance(obj, torch.Tensor):
                return None
            data = _raw(obj)
            if data is None:
                return None
            at = self._at
            self._at += f.write(data)
            return (at, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))

        value = map_tensors(lambda t: t if t.device.type == "cpu" else t.cpu(), value)
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = reference  # type: ignore[method-assign]
        pickler.dump(value)
        blob = buf.getbuffer()
        start = self._at
        self._at += f.write(blob)
        self.index[key] = (start, len(blob))

    put = write

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class SpoolReader:
    """Reads the values a :class:`Spool` wrote, by key (a fresh copy each time)."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path = path
        self.index = {k: (int(v[0]), int(v[1])) for k, v in index.items()}

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def get(self, key: str, default: Any = None) -> Any:
        where = self.index.get(key)
        if where is None:
            return default
        with open(self.path, "rb") as f:
            f.seek(where[0])
            blob = f.read(where[1])

            def load(ref: Any) -> torch.Tensor:
                at, dtype, shape = ref
                dt = getattr(torch, dtype)
                n = 1
                for s in shape:
                    n *= s
                size = n * torch.empty((), dtype=dt).element_size()
                f.seek(at)
                data = bytearray(f.read(size))
                if not data:
                    return torch.empty(shape, dtype=dt)
                return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(shape)

            unpickler = pickle.Unpickler(io.BytesIO(blob))
            unpickler.persistent_load = load  # type: ignore[method-assign]
            return unpickler.load()


class ValueStore:
    """``put(key, value)`` / ``get(key)``; ``key`` a short string such as ``"out12"``.

    In memory until ``max_bytes`` (``None``: no bound) is reached, then appended to a
    :class:`Spool` in ``folder`` (a temporary one when not given). A store over a record folder of
    format 1 reads its ``<key>.pt`` files.
    """

    def __init__(self, max_bytes: int | None = None, folder: str | os.PathLike[str] | None = None):
        self.max_bytes = max_bytes
        self.mem: dict[str, Any] = {}
        self.bytes = 0
        self.spilled = 0
        self._folder = Path(folder) if folder is not None else None
        self._spool: Spool | None = None
        self._reader: SpoolReader | None = None

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="hookscope-compare-"))
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder

    def put(self, key: str, value: Any) -> None:
        if self.max_bytes is None:
            self.mem[key] = value
            return
        size = nbytes(value)
        if self.bytes + size <= self.max_bytes:
            self.mem[key] = value
            self.bytes += size
            return
        self.write(key, value)
        self.spilled += size

    def write(self, key: str, value: Any) -> None:
        if self._spool is None:
            self._spool = Spool(self.folder())
            weakref.finalize(self, self._spool.close)
            self._reader = SpoolReader(self._spool.path, {})
            self._reader.index = self._spool.index  # type: ignore[assignment]
        self._spool.write(key, value)

    def close(self) -> None:
        """No more values: close the file being written (values are still read)."""
        if self._spool is not None:
            self._spool.close()

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.mem:
            return self.mem[key]
        if self._reader is not None and key in self._reader:
            return self._reader.get(key, default)
        if self._folder is None:
            return default
        path = self._folder / f"{key}.pt"  # a record of format 1
        if not path.exists():
            return default
        return torch.load(path, map_location="cpu", weights_only=False)
