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
import threading
import warnings
import weakref
import zlib
from pathlib import Path
from typing import Any

import torch

from ..core._errors import HookscopeError
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


def _as_written(t: torch.Tensor) -> torch.Tensor:
    """A tensor as :meth:`Spool.write` takes it: a dense one as it is (written by reference to
    its bytes), any other on the CPU, detached where autograd made it (pickled whole)."""
    if t.__class__ is torch.Tensor and t.layout is torch.strided and not t.is_quantized:
        return t
    if t.requires_grad and not t.is_leaf:  # (a leaf keeps its kind: a Parameter stays one)
        t = t.detach()
    return t if t.device.type == "cpu" else t.cpu()


def _compare_error(msg: str) -> Exception:
    from ._run import CompareError  # _run imports this module

    return CompareError(msg)


_WHAT = {"in": "inputs", "out": "output", "grad": "output gradient", "ingrad": "input gradient"}


def _describe(key: str) -> str:
    """``"out12"`` -> ``"the output of module call 12"`` (the keys of :class:`~._hooks.CallHooks`)."""
    kind = key.rstrip("0123456789_")
    call = key[len(kind) :].split("_")[0]
    what = _WHAT.get(kind)
    return f"the {what} of module call {call}" if what and call else f"the value {key!r}"


BUFFER = 256 << 10  # what a spool holds before writing to its file (bytes)


class Spool:
    """Values appended to ``folder/values.bin`` as they come, through a buffer of ``BUFFER``
    bytes (a tensor larger than what is left of it goes straight to the file; a step of a small
    model writes hundreds of small values, and a system call each cost about as much as the rest
    of the write); ``index[key] = (offset, length)`` of each value's pickle. :meth:`flush` puts
    what the buffer holds in the file (a reader of an open spool calls it first); :meth:`close`
    ends it.

    The file is created when the spool is (exclusively: a folder whose ``values.bin`` exists, being
    written by another spool or left by a run that was killed, is refused, so two writers never
    overwrite each other's bytes). Writes are serialised by a lock: autograd calls gradient hooks
    from one thread per device."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / SPOOL
        self.index: dict[str, tuple[int, int]] = {}
        self.again: list[str] = []  # keys written a second time (a second backward)
        self.crc = 0  # CRC-32 of every byte written, in order (index.json keeps it)
        # the first write that failed (a full disk, a value that cannot be pickled): its key and
        # error. The file then lacks that value (and may hold part of it), even where the caller
        # went on after the error (an exception caught inside hs.record's block)
        self.failed: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()
        self._at = 0
        # the tensors written, by the memory they view: written once while unchanged (_same)
        self._seen: dict[tuple[Any, ...], tuple[Any, int, tuple[Any, ...]]] = {}
        try:
            self._f: Any = open(self.path, "xb", buffering=BUFFER)  # noqa: SIM115 (see close())
        except FileExistsError:
            raise _compare_error(
                f"hookscope: {str(folder)!r} already holds a {SPOOL}: another hs.record is "
                "writing into this folder, or one was stopped before it finished; give a new or "
                f"empty folder (or delete {SPOOL} if no record is running)"
            ) from None

    def write(self, key: str, value: Any) -> None:
        try:
            self._write(key, value)
        except BaseException as exc:
            if self.failed is None and self._f is not None:
                self.failed = (key, exc)
            raise

    def _write(self, key: str, value: Any) -> None:
        # dense tensors are written as they are (their bytes copied to the CPU by _raw: a
        # tensor seen again is found by the memory it views); others are pickled whole, detached
        value = map_tensors(_as_written, value)
        with self._lock:
            f = self._f
            if f is None:
                raise _compare_error(
                    f"hookscope: {_describe(key)} came after the record in {str(self.path.parent)!r} "
                    "was closed; run the forward and backward inside the `with` block"
                )

            def reference(obj: Any) -> Any:
                if not isinstance(obj, torch.Tensor):
                    return None
                if obj.device.type == "meta":  # a shape without values: nothing to compare
                    raise _compare_error(
                        f"hookscope: {_describe(key)} holds a tensor on the meta device (shape "
                        f"{tuple(obj.shape)}, no values), which cannot be written to "
                        f"{str(self.path)!r}; record a model whose values exist (a meta model "
                        "made real: model.to_empty(device='cpu'), then load its weights)"
                    )
                same = self._same(obj)
                if same is not None and same[0]:
                    return same[0]
                data = _raw(obj)
                if data is None:
                    return None
                at = self._at
                self._at += f.write(data)
                self.crc = zlib.crc32(data, self.crc)
                ref = (at, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
                if same is not None:
                    self._seen[same[1]] = (weakref.ref(obj), obj._version, ref)
                return ref

            buf = io.BytesIO()
            pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.persistent_id = reference  # type: ignore[method-assign]
            try:
                pickler.dump(value)
            except HookscopeError:
                raise
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise _compare_error(
                    f"hookscope: cannot write {_describe(key)} ({type(value).__name__}) to "
                    f"{str(self.path)!r}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}; "
                    "the values are pickled: a class defined inside a function (a local "
                    "namedtuple, dataclass) must be defined at module level"
                ) from None
            blob = buf.getbuffer()
            start = self._at
            self._at += f.write(blob)
            self.crc = zlib.crc32(blob, self.crc)
            if key in self.index:
                self.again.append(key)
            self.index[key] = (start, len(blob))

    def _same(self, t: torch.Tensor) -> tuple[Any, Any] | None:
        """``(reference, key)``: the bytes of ``t`` already written, when a tensor viewing the
        same memory the same way (itself, or an identity view of it: the next call's input is
        the last call's output) was written at the same version and is still alive (so that
        memory is still its own); ``(None, key)`` when not; ``None`` for a tensor without a
        version counter (inference mode) or a non-dense one."""
        if t.__class__ is not torch.Tensor or t.layout is not torch.strided or not t.numel():
            return None
        try:
            version = t._version
        except RuntimeError:  # an inference tensor
            return None
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        hit = self._seen.get(key)
        if hit is not None and hit[1] == version and hit[0]() is not None:
            return hit[2], key
        return None, key

    def put(self, key: str, value: Any) -> None:
        """:meth:`write` (the name the record's hooks call)."""
        self.write(key, value)

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._at

    def flush(self) -> None:
        """What the buffer holds, into the file."""
        with self._lock:
            if self._f is not None:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


class SpoolReader:
    """Reads the values a :class:`Spool` wrote, by key (a fresh copy each time). A file that does
    not hold what the index says (cut short, overwritten) raises :class:`~._run.CompareError`
    naming the folder: never a raw unpickling error, never bytes that are not the value's."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path = path
        self.index = {k: (int(v[0]), int(v[1])) for k, v in index.items()}

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def _damaged(self, why: str) -> Exception:
        return _compare_error(
            f"hs.compare: the record {str(self.path.parent)!r} is damaged: {why}; copy it again "
            "whole, or record again"
        )

    def check(self, checksum: Any = None) -> None:
        """Every value the index names lies inside the file (a file cut short, by a copy or a
        disk that filled, is refused when the record is opened); with ``checksum`` (``[crc32,
        size]`` as the record wrote it), the file is the one written (a byte changed since, or
        the file of another record, is refused)."""
        if checksum is not None:
            self._checksum(checksum)
        if not self.index:
            return
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise self._damaged(f"its index.json lists {len(self.index)} values but there is no "
                                f"{SPOOL}") from None  # fmt: skip
        for key, (at, n) in self.index.items():
            if at < 0 or n <= 0 or at + n > size:
                raise self._damaged(
                    f"{SPOOL} holds {size} bytes, yet index.json places {_describe(key)} at bytes "
                    f"{at}..{at + n} (the file was cut short?)"
                )

    def _checksum(self, checksum: Any) -> None:
        try:
            crc, size = int(checksum[0]), int(checksum[1])
        except (TypeError, ValueError, IndexError):
            raise self._damaged(
                f"the checksum of {SPOOL} in its index.json is not readable"
            ) from None
        try:
            got = self.path.stat().st_size
        except FileNotFoundError:
            raise self._damaged(f"{SPOOL} is missing") from None
        if got != size:
            raise self._damaged(
                f"{SPOOL} holds {got} bytes, {size} were written (cut short, or another file?)"
            )
        value = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(16 << 20):
                value = zlib.crc32(chunk, value)
        if value != crc:
            raise self._damaged(
                f"{SPOOL} is not the file written with its index.json (its checksum differs: "
                "changed since, or the file of another record)"
            )

    def get(self, key: str, default: Any = None) -> Any:
        where = self.index.get(key)
        if where is None:
            return default
        try:
            f = open(self.path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            raise self._damaged(f"{SPOOL} is missing") from None
        with f:
            f.seek(where[0])
            blob = f.read(where[1])
            if len(blob) != where[1]:
                raise self._damaged(
                    f"{_describe(key)} lies at bytes {where[0]}..{sum(where)} of {SPOOL}, which "
                    "ends before (the file was cut short?)"
                )

            def load(ref: Any) -> torch.Tensor:
                at, dtype, shape = ref
                dt = getattr(torch, dtype)
                n = 1
                for s in shape:
                    n *= s
                size = n * torch.empty((), dtype=dt).element_size()
                f.seek(at)
                data = bytearray(f.read(size))
                if len(data) != size:
                    raise self._damaged(
                        f"a tensor of {_describe(key)} lies at bytes {at}..{at + size} of "
                        f"{SPOOL}, which ends before (the file was cut short?)"
                    )
                if not size:
                    return torch.empty(shape, dtype=dt)
                return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(shape)

            unpickler = pickle.Unpickler(io.BytesIO(blob))
            unpickler.persistent_load = load  # type: ignore[method-assign]
            try:
                with warnings.catch_warnings():
                    # a tensor pickled whole (sparse, a Parameter) rebuilds through TypedStorage
                    warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
                    return unpickler.load()
            except (ImportError, AttributeError) as exc:  # a class that is not importable here
                raise _compare_error(
                    f"hs.compare: cannot read {_describe(key)} of the record "
                    f"{str(self.path.parent)!r}: {type(exc).__name__}: {exc}; its values are "
                    "pickled objects: the classes they were made of must be importable here "
                    "(the same module path)"
                ) from None
            except (HookscopeError, Warning):  # ours, or a warning turned into an error
                raise
            except Exception as exc:  # bytes that are no pickle of a value: anything can come
                raise self._damaged(
                    f"{_describe(key)} cannot be read back ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:120] if str(exc) else ''})"
                ) from None


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
        self._temp = False  # the folder is a temporary one this store made
        self._spool: Spool | None = None
        self._reader: SpoolReader | None = None

    @property
    def in_memory(self) -> bool:
        """Whether every value is held in memory (one object per value, read back as that
        object): never spilled to disk, not a record's folder."""
        return self._spool is None and self._folder is None

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="hookscope-compare-"))
            self._temp = True
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

    def __enter__(self) -> ValueStore:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """:meth:`close`; where the run raised, the values are of no use: the temporary folder
        is removed now (the run's graph, its hooks holding this store, may outlive the error
        until the process ends), a record's folder is left as it is."""
        self.close()
        if exc is not None:
            self.discard()

    def discard(self) -> None:
        """Drop every value: the temporary folder and its file removed (a record's folder is
        not this store's to remove)."""
        self.mem.clear()
        if self._spool is not None and self._temp:
            shutil.rmtree(self._spool.path.parent, ignore_errors=True)
            self._reader = None
            self._spool = None

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.mem:
            return self.mem[key]
        if self._reader is not None and key in self._reader:
            if self._spool is not None:
                self._spool.flush()
            return self._reader.get(key, default)
        if self._folder is None:
            return default
        path = self._folder / f"{key}.pt"  # a record of format 1
        if not path.exists():
            return default
        return torch.load(path, map_location="cpu", weights_only=False)
