"""The on-disk format of :func:`hookscope.extract`: memory-mapped ``.npy`` files, a journal, a manifest.

A finished directory is readable with numpy alone::

    out/
      manifest.json      written last, atomically: layers, files, shapes, dtype, count, skipped, versions
      index.npy          one sample id per row: int64 dataset indices, or file paths (unicode)
      <layer>.npy        one array per layer, shape (count, *feature_shape), rows in index order

While a run is in progress (or after it was killed) the directory also holds ``.hookscope-extract/``:
``run.json`` (what is being extracted, written once the ``.npy`` files exist) and one
``journal-<rank>.json`` per process. A journal says how many batches of that process's shard are
on disk; it is replaced atomically (tmp + fsync + rename) only *after* the rows it covers were
flushed (``msync``), so whatever a crash leaves behind, the journal never claims more than is
durable. Re-running the same extraction continues after the last durable batch. The ``.npy`` files
are pre-allocated when created, so a full disk shows up as an error then, not as a ``SIGBUS``
while writing into the mapping.
"""

from __future__ import annotations

import errno
import io
import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from ..core._errors import HookscopeError
from ..core._transfer import ready

__all__ = [
    "ExtractError",
    "Features",
    "IncompleteExtractionError",
    "load_features",
]

FORMAT = "hookscope-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.npy"
STATE_DIR = ".hookscope-extract"
RUN = "run.json"
DONE = "done.json"


class ExtractError(HookscopeError):
    """Dataset extraction failed: a sample could not be loaded, the output cannot be written, or the
    output directory holds something else. The message says what, where and what to do."""


class IncompleteExtractionError(ExtractError):
    """The directory holds an unfinished extraction (no ``manifest.json`` yet)."""


# -- small durable-file helpers --------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ExtractError(f"cannot read {path}: {e}") from None


def layer_files(layers: list[str]) -> dict[str, str]:
    """``{layer: file name}``: ``layer3.npy``, ``blocks.0.attn.npy``; the root module is ``_root.npy``."""
    files: dict[str, str] = {}
    used: set[str] = {INDEX}
    for name in layers:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_root"
        fname, k = f"{base}.npy", 1
        while fname in used:
            fname, k = f"{base}~{k}.npy", k + 1
        used.add(fname)
        files[name] = fname
    return files


def write_failed(out: Path, e: OSError) -> ExtractError:
    """The error for a failed write: what failed, and how many samples the journals hold durable
    (kept: a re-run continues after them)."""
    what = "no space left on device" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
    try:
        done, total = durable_rows(out), (read_run(out) or {}).get("planned", "?")
        kept = f"the {done} of {total} samples durably written so far are kept"
    except ExtractError:
        kept = "the samples durably written so far are kept"
    return ExtractError(
        f"writing features to {out} failed ({what}); {kept}: free space / fix the problem and "
        "run the same extraction again to continue"
    )


def overflow_error(layer: str, dtype: np.dtype) -> ExtractError:
    """A layer's finite values beyond the range of the ``dtype`` they are saved in (float16:
    65504), which the cast turns into inf."""
    return ExtractError(
        f"extract: layer {layer!r} has finite values beyond {dtype.name}'s range "
        f"(|x| > {float(np.finfo(dtype).max):g}) that would be saved as inf; pass "
        "dtype=torch.float32 (or dtype=None: the layer's own dtype), or a pool that scales them; "
        "the batches before this one are kept"
    )


# -- creating and opening the arrays ----------------------------------------------------------------
def state_dir(out: Path) -> Path:
    return out / STATE_DIR


def read_run(out: Path) -> dict[str, Any] | None:
    """The ``run.json`` of an unfinished extraction in ``out``, or ``None``."""
    return read_json(state_dir(out) / RUN)


def layer_dtype(run: dict[str, Any], layer: str) -> np.dtype:
    """The numpy dtype ``layer``'s file holds: its own (``np_dtypes``); ``run["dtype"]``, the one
    shared by every layer, is ``None`` when the layers differ (``np.dtype(None)`` is float64: a
    complex layer beside a real one lost its imaginary part, an int64 layer was rounded)."""
    per_layer = run.get("np_dtypes")
    return np.dtype(per_layer[layer] if isinstance(per_layer, dict) else run["dtype"])


def create_arrays(out: Path, run: dict[str, Any]) -> None:
    """Create (or overwrite) the ``.npy`` files of ``run``, pre-allocated, then write ``run.json``."""
    sdir = state_dir(out)
    if sdir.exists():
        shutil.rmtree(sdir)
    sdir.mkdir(parents=True)
    count = run["count"]
    for layer, fname in run["files"].items():
        path = out / fname
        dtype = layer_dtype(run, layer)
        arr = open_memmap(path, mode="w+", dtype=dtype, shape=(count, *run["shapes"][layer]))
        size = arr.offset + arr.nbytes
        del arr
        with open(path, "r+b") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(size, 1))
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise ExtractError(
                        f"cannot allocate {size / 2**20:.1f} MiB for {path}: {e.strerror or e}"
                    ) from None
            os.fsync(f.fileno())
    fsync_dir(out)
    atomic_write_json(sdir / RUN, run)


def open_arrays(out: Path, run: dict[str, Any]) -> dict[str, np.memmap]:
    """Open the ``.npy`` files of an existing run for writing (``r+``), checking their headers."""
    arrays: dict[str, np.memmap] = {}
    for layer, fname in run["files"].items():
        path = out / fname
        dtype = layer_dtype(run, layer)
        try:
            arr = open_memmap(path, mode="r+")
        except (OSError, ValueError) as e:
            raise ExtractError(
                f"cannot open {path} of the unfinished extraction in {out}: {e}"
            ) from None
        want = (run["count"], *run["shapes"][layer])
        if arr.shape != want or arr.dtype != dtype:
            raise ExtractError(
                f"{path} has shape {arr.shape} {arr.dtype}, expected {want} {dtype}; the directory "
                "was modified: remove it or pass resume=False"
            )
        arrays[layer] = arr
    return arrays


# -- the journal ------------------------------------------------------------------------------------
class Journal:
    """Progress of one process's shard: batches durable on disk and samples skipped so far."""

    def __init__(self, out: Path, rank: int, key: dict[str, Any]) -> None:
        self.path = state_dir(out) / f"journal-{rank}.json"
        self.key = key  # the shard: fingerprint, rank, world size, its global batches
        self.done, self.skipped, self.digests = 0, [], []  # as loaded
        data = read_json(self.path)
        if data and data.get("key") == key:  # this shard, killed since the consolidation
            self.done = int(data["done"])
            self.skipped = list(data["skipped"])
            self.digests = list(data.get("digests", []))[: self.done]

    def save(self, done: int, skipped: list[dict[str, Any]], digests: list[str]) -> None:
        atomic_write_json(
            self.path,
            {"key": self.key, "done": done, "skipped": skipped, "digests": digests[:done]},
        )


def durable_rows(out: Path) -> int:
    """Rows on disk in an unfinished extraction, according to its journals (for messages)."""
    run = read_run(out) or {}
    batch, count = run.get("batch_size", 0), run.get("planned", run.get("count", 0))
    done, _ = done_batches(out, run.get("fingerprint"))
    return sum(max(0, min(count, (k + 1) * batch) - k * batch) for k in done)


def done_batches(
    out: Path, fingerprint: Any, journals: bool = True
) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Global batches durable on disk (``{batch: digest of what it read}``) and the samples
    skipped in them: ``done.json`` (what earlier runs, of any world size, finished) and, with
    ``journals``, every process's journal. (At the start of a run, processes share out the work
    from ``done.json`` alone: a journal may already be growing under another process's hands.)"""
    sdir = state_dir(out)
    base = read_json(sdir / DONE) or {}
    if base.get("fingerprint") != fingerprint:
        base = {}
    done = dict(zip(base.get("batches", []), base.get("digests", [])))
    skipped = {s["row"]: s for s in base.get("skipped", [])}
    for p in sorted(sdir.glob("journal-*.json")) if journals else []:
        data = read_json(p) or {}
        key = data.get("key") or {}
        if key.get("fingerprint") != fingerprint:
            continue
        n = int(data.get("done", 0))
        done.update(zip(key.get("batches", [])[:n], data.get("digests", [])[:n]))
        skipped.update({s["row"]: s for s in data.get("skipped", [])})
    return done, sorted(skipped.values(), key=lambda s: s["row"])


def consolidate(out: Path, fingerprint: Any) -> None:
    """Fold the journals into ``done.json`` (written first, atomically), then delete them: a
    resumed run, of any world size, shares out the batches not done yet afresh."""
    done, skipped = done_batches(out, fingerprint)
    batches = sorted(done)
    atomic_write_json(
        state_dir(out) / DONE,
        {
            "fingerprint": fingerprint,
            "batches": batches,
            "digests": [done[k] for k in batches],
            "skipped": skipped,
        },
    )
    for p in state_dir(out).glob("journal-*.json"):
        p.unlink()


# -- the background writer --------------------------------------------------------------------------
class WriteItem:
    """Rows ``[row0, row0 + n)`` of every layer, or the rows ``rows`` (dataset indices, when a
    sampler chose them): ``feats`` holds the rows of the samples at ``good`` (positions in the
    batch, ``None`` = all), the others are filled (skipped samples)."""

    __slots__ = ("digest", "feats", "good", "n", "overflow", "row0", "rows", "skipped")

    def __init__(
        self,
        row0: int,
        n: int,
        good: list[int] | None,
        feats: dict[str, Any],
        skipped: list[dict[str, Any]],
        rows: list[int] | None = None,
        digest: str = "",
    ) -> None:
        self.row0, self.n, self.good, self.feats, self.skipped = row0, n, good, feats, skipped
        self.rows, self.digest = rows, digest
        # {layer: (bool tensor, numpy storage dtype)}: a finite value became inf in the cast to the
        # storage dtype; the batch is refused before any of its rows is written
        self.overflow: dict[str, Any] = {}


_STOP = object()


class Writer:
    """Writes batches into the memory-mapped arrays on a thread; flushes and journals them.

    ``put`` blocks while ``maxsize`` batches are waiting (bounded memory) and re-raises an error of
    the writing thread; ``close`` drains the queue, makes everything durable and re-raises too.
    """

    def __init__(
        self,
        out: Path,
        arrays: dict[str, np.memmap],
        journal: Journal,
        fill: dict[str, Any],
        *,
        maxsize: int = 4,
        sync_interval: float = 1.0,
    ) -> None:
        self.out, self.arrays, self.journal, self.fill = out, arrays, journal, fill
        done = self.done = journal.done  # continues the journal's shard where it stopped
        self.skipped, self.digests = list(journal.skipped), list(journal.digests)
        self.sync_interval = sync_interval
        self.error: BaseException | None = None
        self._durable = done
        self._q: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(
            target=self._run, name="hookscope-extract-writer", daemon=True
        )
        self._thread.start()

    def put(self, item: WriteItem) -> None:
        self._raise()
        while True:
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                self._raise()
                if not self._thread.is_alive():
                    raise ExtractError("the feature writer thread stopped unexpectedly") from None

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join()
        self._raise()

    def abort(self) -> None:
        """Stop without raising (on the way out of an error): what is durable stays durable."""
        try:
            self.close()
        except BaseException:
            pass

    def _raise(self) -> None:
        e = self.error
        if e is not None:
            if isinstance(e, OSError):
                raise write_failed(self.out, e) from e
            raise e

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            item = self._q.get()
            if item is _STOP:
                break
            if self.error is not None:
                continue  # keep draining so that put() never blocks forever
            try:
                self._write(item)
                if self._q.empty() or time.monotonic() - last >= self.sync_interval:
                    self._sync()
                    last = time.monotonic()
            except BaseException as e:  # re-raised in the main thread
                self.error = e
                try:  # the batches written before this one are kept (the journal says so)
                    self._sync()
                except BaseException:
                    pass
        if self.error is None:
            try:
                self._sync()
            except BaseException as e:
                self.error = e

    def _write(self, item: WriteItem) -> None:
        for layer, (flag, dtype) in item.overflow.items():
            if bool(ready(flag)):
                raise overflow_error(layer, np.dtype(dtype))
        r0, n = item.row0, item.n
        where: Any = slice(r0, r0 + n) if item.rows is None else np.asarray(item.rows)
        for layer, arr in self.arrays.items():
            value = item.feats.get(layer)
            if item.good is None:
                arr[where] = ready(value).numpy()
                continue
            block = np.empty((n, *arr.shape[1:]), dtype=arr.dtype)
            block[...] = self.fill[layer]
            if item.good:
                block[item.good] = ready(value).numpy()
            arr[where] = block
        self.skipped.extend(item.skipped)
        self.digests.append(item.digest)
        self.done += 1

    def _sync(self) -> None:
        if self.done == self._durable:
            return
        for arr in self.arrays.values():
            arr.flush()
        self.journal.save(self.done, self.skipped, self.digests)
        self._durable = self.done


# -- reading a finished directory -------------------------------------------------------------------
class Features(Mapping[str, np.ndarray]):
    """A finished extraction: ``{layer: array}`` (read-only memory maps) plus the sample index.

    Attributes:
        path: the directory.
        manifest: the parsed ``manifest.json``.
        index: one sample id per row (``int64`` dataset indices, or file paths as strings).
        skipped: ``[{"row", "id", "reason"}]`` for samples that could not be loaded
            (``on_error="skip"``); their rows hold NaN (0 for integer dtypes).
        valid: boolean mask of the rows that hold features (``False`` for skipped samples).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, tempfile
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 4))
        >>> d = tempfile.mkdtemp()
        >>> _ = hs.extract(net, data, ["0"], d, batch_size=4, progress=False)
        >>> feats = hs.load_features(d)
        >>> feats["0"].shape, feats.index[:3].tolist(), bool(feats.valid.all())
        ((10, 3), [0, 1, 2], True)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from ._lock import writer_of

        self.path = Path(path)
        writer = writer_of(self.path)
        if writer is not None:
            raise IncompleteExtractionError(
                f"{self.path} is being written by {writer}: wait for that extraction to finish"
            )
        manifest = read_json(self.path / MANIFEST)
        if manifest is None:
            if (state_dir(self.path) / RUN).exists():
                run = read_run(self.path) or {}
                raise IncompleteExtractionError(
                    f"{self.path} holds an unfinished extraction ({durable_rows(self.path)} of "
                    f"{run.get('count', '?')} samples on disk, no manifest.json yet): run the same "
                    "extraction again (resume=True) to finish it"
                )
            if not self.path.is_dir():
                raise ExtractError(f"{self.path} does not exist")
            raise ExtractError(
                f"{self.path} has no {MANIFEST}: it is not a hookscope feature directory"
            )
        if manifest.get("format") != FORMAT:
            raise ExtractError(f"{self.path / MANIFEST} is not a hookscope features manifest")
        self.manifest: dict[str, Any] = manifest
        self.layers: list[str] = list(manifest["layers"])
        self.index: np.ndarray = self._open(manifest["index"], (int(manifest["count"]),), None)
        self.skipped: list[dict[str, Any]] = list(manifest["skipped"])
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, layer: str) -> np.ndarray:
        arr = self._arrays.get(layer)
        if arr is None:
            if layer not in self.layers:
                raise KeyError(
                    f"{layer!r} was not extracted; layers in {self.path}: {', '.join(map(repr, self.layers))}"
                )
            m = self.manifest
            dtypes = m.get("dtypes") if isinstance(m.get("dtypes"), dict) else {}
            arr = self._arrays[layer] = self._open(
                m["files"][layer], tuple(m["shapes"][layer]), dtypes.get(layer, m.get("dtype"))
            )
        return arr

    def _open(self, fname: str, shape: tuple[int, ...], dtype: str | None) -> np.ndarray:
        """``fname`` memory-mapped, checked against the manifest: a file cut short (a copy that
        stopped, a full disk) or replaced by another array is refused, naming it."""
        path = self.path / fname
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ExtractError(
                f"{path} cannot be read ({type(e).__name__}: {e}): the file is damaged or cut "
                "short; extract again (resume=False) or restore the folder"
            ) from None
        if (
            arr.shape == shape
            and dtype is not None
            and arr.dtype == np.float64
            and np.dtype(dtype) != np.float64
            and self.manifest.get("dtype") is None
        ):
            raise ExtractError(
                f"{path} was written by a hookscope that stored layers of different dtypes all as "
                f"float64 (this layer's are {dtype}: complex values lost their imaginary part, "
                "int64 ones were rounded); extract again (resume=False)"
            )
        if arr.shape != shape or (dtype is not None and arr.dtype != np.dtype(dtype)):
            want = f"{shape} {dtype}" if dtype is not None else f"{shape}"
            raise ExtractError(
                f"{path} holds an array of shape {arr.shape} {arr.dtype} where {self.path / MANIFEST} "
                f"says {want}: it was replaced or damaged; extract again (resume=False) or restore "
                "the folder"
            )
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def count(self) -> int:
        """Number of rows (samples), skipped ones included."""
        return int(self.manifest["count"])

    @property
    def valid(self) -> np.ndarray:
        """``True`` for the rows that hold features: not skipped, and chosen by the sampler."""
        mask = np.ones(self.count, dtype=bool)
        for s in self.skipped:
            mask[s["row"]] = False
        mask[np.asarray(self.manifest.get("not_extracted", []), dtype=np.int64)] = False
        return mask

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v)}" for k, v in self.manifest["shapes"].items())
        return f"<Features {str(self.path)!r} {self.count} samples, {shapes}, {self.manifest['dtype']}>"


def load_features(out: str | os.PathLike[str]) -> Features:
    """Open a finished :func:`extract` directory: ``{layer: memory-mapped array}`` and ``.index``.

    Raises:
        IncompleteExtractionError: the extraction in ``out`` has not finished (killed or running);
            run it again to continue.
        ExtractError: ``out`` is not a hookscope feature directory.

    Only numpy is needed to read the files without hookscope: ``np.load("out/avgpool.npy",
    mmap_mode="r")``, ``np.load("out/index.npy")``, ``json.load(open("out/manifest.json"))``.

    Example:
        >>> import tempfile, torch, torch.nn as nn
        >>> from torch.utils.data import TensorDataset
        >>> from hookscope import extract
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        >>> out = tempfile.mkdtemp()
        >>> _ = extract(net, TensorDataset(torch.randn(5, 3)), ["0"], out, progress=False)
        >>> feats = load_features(out)
        >>> feats["0"].shape, feats.index.tolist()
        ((5, 4), [0, 1, 2, 3, 4])
    """
    return Features(out)


def save_index(out: Path, index: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, index, allow_pickle=False)
    atomic_write(out / INDEX, buf.getvalue())
