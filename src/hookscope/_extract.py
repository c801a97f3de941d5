"""``extract``: run a model over a whole dataset and save layer features to disk, resumably.

The pieces: batches are loaded (and their bad samples caught) in ``DataLoader`` workers; the
forward pass runs with one hookscope hook per requested layer, which pools the output on the
device, starts its copy to the host without waiting (:mod:`._transfer`) and stops the pass after
the last requested layer; a background thread writes the rows into memory-mapped ``.npy`` files
and journals them (:mod:`._featstore`). Batches are global (``k * batch_size ...``) and each
process of a ``torch.distributed`` job takes a contiguous block of them, so every batch, and thus
every byte written, is the same whatever the number of processes or interruptions.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler
from torch.utils.data._utils.collate import default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin

from ._errors import HookscopeWarning, LayerNotRunError
from ._featstore import (
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    ExtractError,
    Features,
    Journal,
    WriteItem,
    Writer,
    atomic_write_json,
    create_arrays,
    layer_files,
    load_features,
    open_arrays,
    read_json,
    read_run,
    save_index,
    state_dir,
)
from ._imagefolder import ImageFolder
from ._nested import describe, first_tensor
from ._progress import Progress
from ._scope import HookScope, check_model
from ._select import resolve
from ._transfer import move

__all__ = ["Pool", "extract"]

Pool = Literal["avg", "max", "flatten", "cls"] | Callable[[torch.Tensor], torch.Tensor] | None
"""How a layer's output ``(B, ...)`` becomes the saved row: ``None`` keeps it whole; ``"avg"`` /
``"max"`` reduce the spatial dims of ``(B, C, *spatial)`` (or the tokens of ``(B, T, D)``);
``"flatten"`` gives ``(B, -1)``; ``"cls"`` keeps the first token of ``(B, T, D)``; a callable
``fn(output) -> (B, ...)`` does anything else."""

_POOLS = ("avg", "max", "flatten", "cls")


# -- pooling ------------------------------------------------------------------------------------------
def _reduce_dims(t: torch.Tensor) -> tuple[int, ...]:
    if t.dim() >= 4:
        return tuple(range(2, t.dim()))
    if t.dim() == 3:
        return (1,)
    return ()


def _pool_fn(pool: Pool) -> tuple[Callable[[torch.Tensor, str], torch.Tensor], str]:
    """``(fn(output, layer) -> rows, name)`` for a ``pool`` argument."""
    if pool is None:
        return (lambda t, layer: t), "none"
    if isinstance(pool, str):
        if pool == "avg":
            return (lambda t, layer: t.mean(dim=_reduce_dims(t)) if t.dim() >= 3 else t), "avg"
        if pool == "max":
            return (lambda t, layer: t.amax(dim=_reduce_dims(t)) if t.dim() >= 3 else t), "max"
        if pool == "flatten":
            return (lambda t, layer: t.flatten(1) if t.dim() > 1 else t), "flatten"
        if pool == "cls":

            def cls(t: torch.Tensor, layer: str) -> torch.Tensor:
                if t.dim() < 3:
                    raise ExtractError(
                        f'pool="cls" keeps the first token of a (batch, tokens, dim) output, but layer '
                        f"{layer!r} gives shape {tuple(t.shape)}; use pool=None, 'flatten' or a callable"
                    )
                return t[:, 0]

            return cls, "cls"
        raise ValueError(f"pool must be None, one of {', '.join(map(repr, _POOLS))} or a callable; got {pool!r}")
    if callable(pool):

        def custom(t: torch.Tensor, layer: str) -> torch.Tensor:
            r = pool(t)
            if not isinstance(r, torch.Tensor) or r.dim() == 0 or r.shape[0] != t.shape[0]:
                got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise ExtractError(
                    f"pool callable {getattr(pool, '__name__', pool)!r} must return a (batch, ...) tensor; "
                    f"for layer {layer!r} output {tuple(t.shape)} it returned {got}"
                )
            return r

        return custom, f"callable:{getattr(pool, '__module__', '?')}.{getattr(pool, '__qualname__', type(pool).__name__)}"
    raise ValueError(f"pool must be None, one of {', '.join(map(repr, _POOLS))} or a callable; got {pool!r}")


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        raise ExtractError("numpy has no bfloat16: save features as torch.float16 or torch.float32")
    return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)


# -- loading batches, catching bad samples ----------------------------------------------------------
class _Failed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class _SafeDataset(Dataset):
    """``(i, sample)``, or ``(i, _Failed(reason))`` when ``dataset[i]`` raises."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        try:
            return i, self.dataset[i]
        except Exception as e:
            return i, _Failed(_reason(e))


class _Batch:
    __slots__ = ("data", "failed", "good", "indices")

    def __init__(self, indices: list[int], good: list[int], data: Any, failed: list[tuple[int, str]]) -> None:
        self.indices, self.good, self.data, self.failed = indices, good, data, failed

    def pin_memory(self) -> _Batch:
        self.data = _pin(self.data)
        return self


class _SafeCollate:
    """Collate the samples that loaded with the user's ``collate_fn``; keep the failures aside."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[int, Any]]) -> _Batch:
        good = [k for k, (_, s) in enumerate(items) if not isinstance(s, _Failed)]
        failed = [(i, s.reason) for i, s in items if isinstance(s, _Failed)]
        data = self.collate([items[k][1] for k in good]) if good else None
        return _Batch([i for i, _ in items], good, data, failed)


class _Batches:
    """Batch sampler over global batches ``start .. stop``: batch ``k`` is rows ``[k*B, (k+1)*B)``."""

    def __init__(self, start: int, stop: int, batch_size: int, n: int) -> None:
        self.start, self.stop, self.batch_size, self.n = start, stop, batch_size, n

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        for k in range(self.start, self.stop):
            yield list(range(k * b, min(self.n, (k + 1) * b)))


def _as_dataset(data: Any, batch_size: int, num_workers: int) -> tuple[Any, int, int, Callable[..., Any], dict[str, Any]]:
    """``(dataset, batch_size, num_workers, collate_fn, other DataLoader options)``."""
    if isinstance(data, (str, os.PathLike)):
        return ImageFolder(data), batch_size, num_workers, default_collate, {}
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise TypeError("extract needs a map-style dataset (len + indexing) so that runs can resume; got an IterableDataset")
        if data.batch_size is None:
            raise ValueError("extract needs a DataLoader with a batch_size (not a custom batch_sampler); or pass the dataset")
        if not isinstance(data.sampler, SequentialSampler):
            warnings.warn(
                f"extract ignores the DataLoader's {type(data.sampler).__name__}: rows are saved in dataset "
                "order so that runs can resume and shard across processes",
                HookscopeWarning,
                stacklevel=3,
            )
        kw: dict[str, Any] = {"pin_memory": data.pin_memory, "worker_init_fn": data.worker_init_fn, "timeout": data.timeout}
        if data.num_workers > 0:
            kw["multiprocessing_context"] = data.multiprocessing_context
            kw["prefetch_factor"] = data.prefetch_factor
        return data.dataset, data.batch_size, data.num_workers, data.collate_fn, kw
    if isinstance(data, IterableDataset):
        raise TypeError("extract needs a map-style dataset (len + indexing) so that runs can resume; got an IterableDataset")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"data must be a Dataset (len + indexing), a DataLoader or an image folder path; got {type(data).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return data, batch_size, num_workers, default_collate, {}


def _index(dataset: Any) -> np.ndarray:
    """One id per sample: ``sample_id(i)`` or ``samples[i][0]`` (file paths) if known, else ``i``."""
    n = len(dataset)
    sid = getattr(dataset, "sample_id", None)
    if callable(sid):
        return np.array([str(sid(i)) for i in range(n)], dtype=str)
    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and len(samples) == n and samples and isinstance(samples[0], tuple) and isinstance(samples[0][0], str):
        root = getattr(dataset, "root", None)
        paths = [s[0] for s in samples]
        if root is not None:
            paths = [os.path.relpath(p, root) for p in paths]
        return np.array(paths, dtype=str)
    return np.arange(n, dtype=np.int64)


def _sample_name(index: np.ndarray, i: int) -> str:
    return f"sample {i}" if index.dtype.kind in "iu" else f"sample {i} ({index[i]})"


# -- running the model ------------------------------------------------------------------------------
class _Runner:
    """One forward pass per batch with a hook per layer: pool, cast, copy to host, stop early."""

    def __init__(self, model: nn.Module, named: dict[str, nn.Module], pool: Callable[[torch.Tensor, str], torch.Tensor], device: torch.device) -> None:
        self.model, self.named, self.pool, self.device = model, named, pool, device
        self.dtypes: dict[str, torch.dtype] = {}
        self.host = torch.device("cpu")

    def _hook(self, name: str, got: dict[str, Any], pending: set[str], scope: HookScope) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in got:  # a module used several times: its first call counts
                return
            t = first_tensor(output)
            if t is None:
                raise ExtractError(f"layer {name!r} returned {describe(output)}, which holds no tensor to save")
            f = self.pool(t, name)
            want = self.dtypes.get(name, torch.float32 if f.dtype == torch.bfloat16 else f.dtype)
            if f.dtype != want:
                f = f.to(want)
            pending.discard(name)
            if pending and f.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                f = f.clone()  # the rest of the forward pass may modify the activation in place
            got[name] = move(f, self.host) if f.device != self.host else f
            if not pending:
                raise scope.stop_signal()

        return hook

    def __call__(self, data: Any) -> dict[str, Any]:
        got: dict[str, Any] = {}
        pending = set(self.named)
        with HookScope("extract") as scope:
            for name, module in self.named.items():
                scope.add_forward(module, self._hook(name, got, pending, scope), layer=name)
            self._forward(data)
        if pending:
            raise LayerNotRunError(
                f"extract: layer(s) {', '.join(map(repr, sorted(pending)))} of {type(self.model).__name__} never "
                "ran during the forward pass (called via .forward() directly, or not on this input's path)"
            )
        return got

    def _forward(self, data: Any) -> Any:
        dev = self.device

        def to(x: Any) -> Any:
            return x.to(dev, non_blocking=True) if isinstance(x, torch.Tensor) else x

        if isinstance(data, torch.Tensor):
            return self.model(to(data))
        if isinstance(data, (tuple, list)):
            return self.model(to(data[0]))
        if isinstance(data, Mapping):
            return self.model(**{k: to(v) for k, v in data.items()})
        raise TypeError(
            f"a batch must be a tensor, a (input, ...) tuple/list or a dict of model kwargs; got {type(data).__name__}"
        )


class _Prepared:
    """Eval mode (and ``device`` if given) for the run; the model's modes and device restored after."""

    def __init__(self, model: nn.Module, device: torch.device | None) -> None:
        self.model, self.device = model, device
        self.modes = [(m, m.training) for m in model.modules()]
        self.orig = _model_device(model)

    def __enter__(self) -> torch.device:
        self.model.eval()
        if self.device is not None and self.device != self.orig:
            self.model.to(self.device)
            return self.device
        return self.orig

    def __exit__(self, *exc: Any) -> None:
        if self.device is not None and self.device != self.orig:
            self.model.to(self.orig)
        for m, mode in self.modes:
            m.training = mode


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


# -- the run ----------------------------------------------------------------------------------------
def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _model_name(model: nn.Module) -> str:
    """``package.module.Class``; for a model loaded from a file (CLI ``path.py:Name``) ``path.py:Class``,
    stable across processes (the module name the loader invents is not)."""
    cls = type(model)
    mod = sys.modules.get(cls.__module__)
    if cls.__module__.startswith("_hookscope_user_") and getattr(mod, "__file__", None):
        return f"{Path(mod.__file__).name}:{cls.__qualname__}"  # type: ignore[union-attr, arg-type]
    return f"{cls.__module__}.{cls.__qualname__}"


def _fingerprint(model: nn.Module, names: list[str], pool: str, dtype: torch.dtype | None, n: int, batch_size: int, index: np.ndarray) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}:".encode())
        if v.numel() and v.dtype != torch.bfloat16:
            # ~64 exact values per tensor: tells different weights apart, device-independent, cheap
            sample = v.detach().reshape(-1)[:: max(1, v.numel() // 64)].cpu().contiguous()
            h.update(sample.numpy().tobytes())
        elif v.numel():
            h.update(v.detach().reshape(-1)[:: max(1, v.numel() // 64)].float().cpu().numpy().tobytes())
    desc = {
        "model": _model_name(model),
        "weights": h.hexdigest(),
        "layers": names,
        "pool": pool,
        "dtype": str(dtype),
        "count": n,
        "batch_size": batch_size,
        "index": hashlib.sha256(index.tobytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]


def _probe(runner: _Runner, dataset: Any, collate: Callable[..., Any], index: np.ndarray, on_error: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every layer's rows, from the first sample that loads."""
    for i in range(len(dataset)):
        try:
            sample = dataset[i]
        except Exception as e:
            if on_error == "raise":
                raise _sample_error(index, i, _reason(e)) from e
            continue
        feats = runner(collate([sample]))
        return {k: (tuple(v.shape[1:]), v.dtype) for k, v in ((k, _host(v)) for k, v in feats.items())}
    raise ExtractError(f"none of the {len(dataset)} samples could be loaded; nothing to extract")


def _host(value: Any) -> torch.Tensor:
    from ._transfer import ready

    return ready(value)


def _sample_error(index: np.ndarray, i: int, reason: str) -> ExtractError:
    err = ExtractError(
        f"{_sample_name(index, i)} could not be loaded: {reason}; fix or remove it, or use on_error='skip' "
        "(CLI: --on-error skip) to record it in the manifest and go on"
    )
    err.sample = i  # type: ignore[attr-defined]
    return err


def extract(
    model: nn.Module,
    data: Any,
    layers: Any,
    out: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    pool: Pool = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    resume: bool = True,
    progress: bool = True,
    on_error: Literal["raise", "skip"] = "raise",
) -> Features:
    """Run ``model`` over every sample of ``data`` and save the outputs of ``layers`` to ``out``.

    The forward pass stops after the last requested layer. Rows are saved in dataset order into one
    memory-mapped ``<layer>.npy`` per layer, with ``index.npy`` (sample ids: dataset indices, or
    file paths for image folders) and ``manifest.json``, written last: a directory is complete iff
    it has a manifest. Everything is readable with numpy alone; :func:`load_features` opens it.

    The run can be killed at any moment: running the same call again (``resume=True``) continues
    after the last batch that was durably on disk, and the finished files are byte for byte those
    of an uninterrupted run. Under ``torch.distributed`` (e.g. ``torchrun``), each process takes a
    contiguous block of batches and writes its rows into the shared files (``out`` must be on a
    file system all processes see); rank 0 writes the manifest. The result is the same as one
    process's.

    Args:
        model: any ``nn.Module``; run in eval mode under ``torch.inference_mode()`` (its modes,
            device and hooks are left as found).
        data: a map-style ``Dataset`` whose samples are a tensor, an ``(input, ...)`` tuple (e.g.
            ``(image, label)``) or a dict of model keyword arguments; a ``DataLoader`` (its
            dataset, batch size, workers and ``collate_fn`` are used, its sampler is not: rows are
            in dataset order); or the path of an image folder (:class:`ImageFolder`, 224 px).
        layers: layer selectors (names, globs, types, see :func:`find`).
        out: output directory (created if needed).
        batch_size, num_workers: for the ``DataLoader`` built over ``data`` (unless one is given).
        pool: ``None``, ``"avg"``, ``"max"``, ``"flatten"``, ``"cls"`` or ``fn(output) -> (B, ...)``
            (see :data:`Pool`); applied on the model's device before the copy to the host.
        dtype: dtype to save (default: each layer's own; bfloat16 is saved as float32).
        device: where to run (default: the model's device); the model is moved back after.
        resume: continue an unfinished run in ``out`` (or return a finished one). ``False``
            starts over, overwriting ``out``'s features.
        progress: show a progress line (samples/s, ETA) on stderr when it is a terminal.
        on_error: a sample whose loading raises: ``"raise"`` stops with an :class:`ExtractError`
            naming it (work done so far is kept); ``"skip"`` records it in the manifest's
            ``skipped`` list and goes on. A skipped sample's row holds NaN (0 for integer
            dtypes), identical across resumes; ``Features.valid`` masks such rows.

    Returns:
        :class:`Features` of the finished directory.

    Raises:
        ExtractError: a sample failed (``on_error="raise"``), writing failed (disk full: the work
            so far is kept, re-run to continue), or ``out`` holds a different extraction.

    Example:
        >>> import torch, torch.nn as nn, numpy as np, hookscope as hs, tempfile
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 3, 8, 8))
        >>> feats = hs.extract(net, data, ["1"], tempfile.mkdtemp(), pool="avg", batch_size=4, progress=False)
        >>> feats["1"].shape, feats["1"].dtype
        ((10, 4), dtype('float32'))
        >>> ref = net[1](net[0](data.tensors[0])).mean((2, 3))
        >>> np.allclose(feats["1"], ref.detach().numpy(), atol=1e-6)
        True
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    pool_fn, pool_name = _pool_fn(pool)
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.float16, got {dtype!r}")
        _np_dtype(dtype)
    check_model(model)
    named = resolve(model, layers)
    names = list(named)
    dataset, batch_size, num_workers, collate, loader_kw = _as_dataset(data, batch_size, num_workers)
    n = len(dataset)
    if n == 0:
        raise ExtractError("the dataset is empty: nothing to extract")
    index = _index(dataset)
    out = Path(out)
    rank, world = _dist()
    if world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExtractError(
            f"this process runs under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}) but torch.distributed is "
            "not initialized, so every process would extract everything into the same files: call "
            "torch.distributed.init_process_group('gloo') first (the hookscope CLI does)"
        )
    dev = torch.device(device) if device is not None else None
    fingerprint = _fingerprint(model, names, pool_name, dtype, n, batch_size, index)

    manifest = read_json(out / MANIFEST) if resume else None
    if manifest is not None:
        if manifest.get("fingerprint") != fingerprint:
            raise ExtractError(
                f"{out} already holds a finished extraction of another run (model {manifest.get('model')}, "
                f"layers {manifest.get('layers')}, {manifest.get('count')} samples); choose another output "
                "directory, or pass resume=False (CLI: --no-resume) to overwrite it"
            )
        _barrier(world)
        if rank == 0 and state_dir(out).exists():
            shutil.rmtree(state_dir(out), ignore_errors=True)
        return load_features(out)

    nb = -(-n // batch_size)
    first, stop = rank * nb // world, (rank + 1) * nb // world
    with _Prepared(model, dev) as run_dev:
        runner = _Runner(model, named, pool_fn, run_dev)
        if rank == 0:
            _prepare(out, runner, dataset, collate, index, fingerprint, names, dtype, n, batch_size, world, resume, on_error)
        _barrier(world)
        run = read_run(out)
        if run is None or run["fingerprint"] != fingerprint:
            raise ExtractError(f"{out}: the extraction state written by rank 0 is missing or differs")
        runner.dtypes = {k: getattr(torch, v) for k, v in run["dtypes"].items()}
        key = {"fingerprint": fingerprint, "rank": rank, "world_size": world, "first_batch": first, "stop_batch": stop}
        journal = Journal(out, rank)
        done, skipped = journal.load(key)
        rows_first, rows_stop = first * batch_size, min(n, stop * batch_size)
        rows_done = min(rows_stop, (first + done) * batch_size) - rows_first
        if done and progress and rank == 0:
            print(f"hookscope extract: resuming {out}: {rows_done} of {rows_stop - rows_first} samples already on disk", file=sys.stderr)
        _run_shard(
            out, run, runner, dataset, collate, loader_kw, index, journal, key, done, skipped,
            batch_size=batch_size, num_workers=num_workers, first=first, stop=stop, n=n,
            rows_done=rows_done, progress=progress and rank == 0, on_error=on_error,
        )
    _barrier(world)
    if rank == 0:
        _finish(out, run, model, index, pool_name, batch_size, world, nb)
    _barrier(world)
    return load_features(out)


def _prepare(
    out: Path, runner: _Runner, dataset: Any, collate: Callable[..., Any], index: np.ndarray, fingerprint: str,
    names: list[str], dtype: torch.dtype | None, n: int, batch_size: int, world: int, resume: bool, on_error: str,
) -> None:
    """Rank 0: validate an unfinished run in ``out``, or create the arrays of a new one."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExtractError(f"cannot create the output directory {out}: {e}") from None
    run = read_run(out) if resume else None
    if run is not None:
        if run.get("fingerprint") != fingerprint:
            raise ExtractError(
                f"{out} holds an unfinished extraction of another run (model {run.get('model')}, layers "
                f"{run.get('layers')}); re-run that one to finish it, choose another output directory, "
                "or pass resume=False (CLI: --no-resume) to start over"
            )
        if run.get("world_size") != world:
            raise ExtractError(
                f"the unfinished extraction in {out} was started with {run.get('world_size')} process(es); "
                f"resume it with the same number (now {world}), or pass resume=False to start over"
            )
        return
    (out / MANIFEST).unlink(missing_ok=True)
    with torch.inference_mode():
        probed = _probe(runner, dataset, collate, index, on_error)
    dtypes = {k: (dtype if dtype is not None else (torch.float32 if d == torch.bfloat16 else d)) for k, (_, d) in probed.items()}
    run = {
        "fingerprint": fingerprint,
        "model": _model_name(runner.model),
        "layers": names,
        "files": layer_files(names),
        "shapes": {k: list(probed[k][0]) for k in names},
        "dtypes": {k: str(dtypes[k]).removeprefix("torch.") for k in names},
        "dtype": str(_np_dtype(dtypes[names[0]])) if len({dtypes[k] for k in names}) == 1 else None,
        "count": n,
        "batch_size": batch_size,
        "world_size": world,
    }
    run["np_dtypes"] = {k: str(_np_dtype(dtypes[k])) for k in names}
    try:
        create_arrays(out, run)
    except OSError as e:
        raise ExtractError(f"cannot create the feature files in {out}: {e}") from None


def _run_shard(
    out: Path, run: dict[str, Any], runner: _Runner, dataset: Any, collate: Callable[..., Any],
    loader_kw: dict[str, Any], index: np.ndarray, journal: Journal, key: dict[str, Any], done: int,
    skipped: list[dict[str, Any]], *, batch_size: int, num_workers: int, first: int, stop: int, n: int,
    rows_done: int, progress: bool, on_error: str,
) -> None:
    """Extract batches ``first + done .. stop`` of this process's shard."""
    arrays = open_arrays(out, run)
    np_dtypes = {k: np.dtype(v) for k, v in run["np_dtypes"].items()}
    fill = {k: (np.nan if d.kind in "fc" else 0) for k, d in np_dtypes.items()}
    rows_first, rows_stop = first * batch_size, min(n, stop * batch_size)
    writer = Writer(
        out, arrays, journal, key, done=done, skipped=skipped, fill=fill,
        total=rows_stop - rows_first, rows_done=rows_done,
    )
    batches = _Batches(first + done, stop, batch_size, n)
    kw = dict(loader_kw)
    if runner.device.type == "cuda" and "pin_memory" not in kw:
        kw["pin_memory"] = True
    loader = DataLoader(_SafeDataset(dataset), batch_sampler=batches, collate_fn=_SafeCollate(collate), num_workers=num_workers, **kw)
    bar = Progress(rows_stop - rows_first, done=rows_done, enabled=progress)
    try:
        with torch.inference_mode():
            for batch in loader:
                now_skipped: list[dict[str, Any]] = []
                if batch.failed:
                    if on_error == "raise":
                        writer.close()  # what came before is durable
                        i, reason = batch.failed[0]
                        raise _sample_error(index, i, reason)
                    now_skipped = [{"row": i, "id": index[i].item(), "reason": r} for i, r in batch.failed]
                feats = runner(batch.data) if batch.good else {}
                good = None if not batch.failed else batch.good
                writer.put(WriteItem(batch.indices[0], len(batch.indices), good, feats, now_skipped))
                bar.update(len(batch.indices))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        arrays.clear()  # unmap (the writer shares this dict)


def _finish(out: Path, run: dict[str, Any], model: nn.Module, index: np.ndarray, pool: str, batch_size: int, world: int, nb: int) -> None:
    """Rank 0, after every process finished: check the journals, write index and manifest."""
    from . import __version__

    skipped: list[dict[str, Any]] = []
    for r in range(world):
        first, stop = r * nb // world, (r + 1) * nb // world
        key = {"fingerprint": run["fingerprint"], "rank": r, "world_size": world, "first_batch": first, "stop_batch": stop}
        done, sk = Journal(out, r).load(key)
        if done != stop - first:
            raise ExtractError(f"process {r} did not finish its shard ({done} of {stop - first} batches); run the extraction again")
        skipped += sk
    skipped.sort(key=lambda s: s["row"])
    save_index(out, index)
    n = run["count"]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": run["fingerprint"],
        "model": run["model"],
        "layers": run["layers"],
        "files": run["files"],
        "shapes": {k: [n, *v] for k, v in run["shapes"].items()},
        "dtype": run["dtype"],
        "dtypes": run["np_dtypes"],
        "pool": pool,
        "count": n,
        "valid": n - len(skipped),
        "batch_size": batch_size,
        "index": INDEX,
        "index_kind": "path" if index.dtype.kind == "U" else "dataset_index",
        "skipped": skipped,
        "skipped_rows_hold": "nan (0 for integer dtypes)",
        "versions": {
            "hookscope": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
    }
    atomic_write_json(out / MANIFEST, manifest)
    shutil.rmtree(state_dir(out), ignore_errors=True)
