"""``extract``: run a model over a whole dataset and save layer features to disk, resumably.

The pieces: batches are loaded (and their bad samples caught) in ``DataLoader`` workers; the
forward pass runs with one hookscope hook per requested layer, which pools the output on the
device, starts its copy to the host without waiting (:mod:`._transfer`) and stops the pass after
the last requested layer; a background thread writes the rows into memory-mapped ``.npy`` files
and journals them (:mod:`._featstore`). Batches are global (``k * batch_size ...``) and each
process of a ``torch.distributed`` job takes a contiguous block of them, so every batch is the same
whatever the number of processes or interruptions. The rows are thus those of an uninterrupted run
up to the rounding of the kernels, which may depend on the number of CPU threads and the device;
byte for byte when every process runs the same kernels (see ``extract``'s docstring).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ..core._progress import progress_bar
from ..core._scope import check_model
from ..core._select import resolve
from ._data import (
    Batches,
    SafeCollate,
    SafeDataset,
    as_dataset,
    reason,
    sample_error,
    sample_index,
    sampled_rows,
)
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
    consolidate,
    create_arrays,
    done_batches,
    layer_files,
    load_features,
    open_arrays,
    read_json,
    read_run,
    save_index,
    state_dir,
)
from ._forward import Pool, Prepared, Runner, host, np_dtype, pool_fn

__all__ = ["extract"]


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


def _fingerprint(
    model: nn.Module,
    names: list[str],
    pool: str,
    dtype: torch.dtype | None,
    n: int,
    batch_size: int,
    index: np.ndarray,
    plan: np.ndarray | None = None,
) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}:".encode())
        if v.numel() and v.dtype != torch.bfloat16:
            # ~64 exact values per tensor: tells different weights apart, device-independent, cheap
            sample = v.detach().reshape(-1)[:: max(1, v.numel() // 64)].cpu().contiguous()
            h.update(sample.numpy().tobytes())
        elif v.numel():
            h.update(
                v.detach().reshape(-1)[:: max(1, v.numel() // 64)].float().cpu().numpy().tobytes()
            )
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
    if plan is not None:  # a sampler chose the rows
        desc["rows"] = hashlib.sha256(plan.tobytes()).hexdigest()
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]


def _probe(
    runner: Runner, dataset: Any, collate: Callable[..., Any], index: np.ndarray, on_error: str
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every layer's rows, from the first sample that loads."""
    for i in range(len(dataset)):
        try:
            sample = dataset[i]
        except Exception as e:
            if on_error == "raise":
                raise sample_error(index, i, reason(e)) from e
            continue
        feats = runner(collate([sample]))
        return {
            k: (tuple(v.shape[1:]), v.dtype) for k, v in ((k, host(v)) for k, v in feats.items())
        }
    raise ExtractError(f"none of the {len(dataset)} samples could be loaded; nothing to extract")


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
    after the last batch that was durably on disk. Under ``torch.distributed`` (e.g. ``torchrun``),
    each process takes a contiguous block of the batches not done yet and writes its rows into the
    shared files (``out`` must be on a file system all processes see); rank 0 writes the manifest;
    a run may resume with another number of processes.

    What is promised: every sample is computed in the same batch (same neighbours, same position)
    as in an uninterrupted one-process run, whatever the interruptions and the number of
    processes, so the finished files equal that run's within float rounding. They are byte for
    byte identical when every process runs the same kernels: the same device and the same number
    of CPU threads (``torch.get_num_threads()``; ``torchrun`` starts its processes with
    ``OMP_NUM_THREADS=1``), e.g. a run resumed on the same machine with the same settings. A CPU
    kernel's last bits can change with the thread count, so a resume at another thread count may
    differ in the last bit of some values.

    Args:
        model: any ``nn.Module``; run in eval mode under ``torch.inference_mode()`` (its modes,
            device and hooks are left as found).
        data: a map-style ``Dataset`` whose samples are a tensor, an ``(input, ...)`` tuple (e.g.
            ``(image, label)``) or a dict of model keyword arguments; a ``DataLoader`` (its
            dataset, batch size, workers, ``collate_fn`` and sampler are used: the samples its
            sampler yields are extracted, each written at its dataset index; a
            ``DistributedSampler`` stands for the union of its replicas; rows no sampler chose
            hold NaN and are ``False`` in ``Features.valid``); or the path of an image folder (:class:`ImageFolder`, 224 px).
        layers: layer selectors (names, globs, types, see :func:`find`). A layer called several
            times in one forward pass contributes its first call.
        out: output directory (created if needed).
        batch_size, num_workers: for the ``DataLoader`` built over ``data`` (unless one is given).
        pool: ``None``, ``"avg"``, ``"max"``, ``"flatten"``, ``"cls"`` or ``fn(output) -> (B, ...)``
            (see :data:`Pool`); applied on the model's device before the copy to the host.
        dtype: dtype to save (default: each layer's own; bfloat16 is saved as float32).
        device: where to run (default: the model's device); the model is moved back after.
        resume: continue an unfinished run in ``out`` (or return a finished one). ``False``
            starts over, overwriting ``out``'s features.
        progress: show a progress bar (samples/s, ETA): tqdm's widget in a Jupyter notebook, a
            bar on stderr when it is a terminal, nothing otherwise. ``False`` turns it off.
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
    pooling, pool_name = pool_fn(pool)
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.float16, got {dtype!r}")
        np_dtype(dtype)
    check_model(model)
    named = resolve(model, layers)
    names = list(named)
    dataset, batch_size, num_workers, collate, loader_kw = as_dataset(data, batch_size, num_workers)
    n = len(dataset)
    if n == 0:
        raise ExtractError("the dataset is empty: nothing to extract")
    index = sample_index(dataset)
    plan = sampled_rows(data, n)
    if plan is not None and len(plan) == 0:
        raise ExtractError("the DataLoader's sampler yields no sample: nothing to extract")
    out = Path(out)
    rank, world = _dist()
    if world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExtractError(
            f"this process runs under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}) but torch.distributed is "
            "not initialized, so every process would extract everything into the same files: call "
            "torch.distributed.init_process_group('gloo') first (the hookscope CLI does)"
        )
    dev = torch.device(device) if device is not None else None
    fingerprint = _fingerprint(model, names, pool_name, dtype, n, batch_size, index, plan)

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

    planned = n if plan is None else len(plan)
    nb = -(-planned // batch_size)
    with Prepared(model, dev) as run_dev:
        runner = Runner(model, named, pooling, run_dev)
        if rank == 0:
            _prepare(
                out,
                runner,
                dataset,
                collate,
                index,
                fingerprint,
                names,
                dtype,
                n,
                batch_size,
                planned,
                resume,
                on_error,
            )
        _barrier(world)
        run = read_run(out)
        if run is None or run["fingerprint"] != fingerprint:
            raise ExtractError(
                f"{out}: the extraction state written by rank 0 is missing or differs"
            )
        runner.dtypes = {k: getattr(torch, v) for k, v in run["dtypes"].items()}
        # the batches not done yet (by a run of any world size), shared out in contiguous blocks
        finished, _ = done_batches(out, fingerprint, journals=False)  # the same on every rank
        todo = [k for k in range(nb) if k not in finished]
        mine = todo[rank * len(todo) // world : (rank + 1) * len(todo) // world]
        key = {"fingerprint": fingerprint, "rank": rank, "world_size": world, "batches": mine}
        journal = Journal(out, rank)
        done, skipped = journal.load(key)  # (0, []) unless killed since the consolidation

        def rows_of(ks: list[int]) -> int:
            return sum(min(planned, (k + 1) * batch_size) - k * batch_size for k in ks)

        rows_done = rows_of(mine[:done])
        if finished and progress and rank == 0:
            print(
                f"hookscope extract: resuming {out}: {rows_of(sorted(finished))} of {planned} samples already on disk",
                file=sys.stderr,
            )
        _run_shard(
            out,
            run,
            runner,
            dataset,
            collate,
            loader_kw,
            index,
            journal,
            key,
            done,
            skipped,
            batch_size=batch_size,
            num_workers=num_workers,
            mine=mine,
            plan=plan,
            n=n,
            total=rows_of(mine),
            rows_done=rows_done,
            progress=progress and rank == 0,
            on_error=on_error,
        )
    _barrier(world)
    if rank == 0:
        _finish(out, run, model, index, pool_name, batch_size, plan, nb)
    _barrier(world)
    return load_features(out)


def _prepare(
    out: Path,
    runner: Runner,
    dataset: Any,
    collate: Callable[..., Any],
    index: np.ndarray,
    fingerprint: str,
    names: list[str],
    dtype: torch.dtype | None,
    n: int,
    batch_size: int,
    planned: int,
    resume: bool,
    on_error: str,
) -> None:
    """Rank 0: validate an unfinished run in ``out`` and fold its journals into ``done.json``
    (so that any number of processes can share out what is left), or create a new one."""
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
        consolidate(out, fingerprint)
        return
    (out / MANIFEST).unlink(missing_ok=True)
    with torch.inference_mode():
        probed = _probe(runner, dataset, collate, index, on_error)
    dtypes = {
        k: (dtype if dtype is not None else (torch.float32 if d == torch.bfloat16 else d))
        for k, (_, d) in probed.items()
    }
    run = {
        "fingerprint": fingerprint,
        "model": _model_name(runner.model),
        "layers": names,
        "files": layer_files(names),
        "shapes": {k: list(probed[k][0]) for k in names},
        "dtypes": {k: str(dtypes[k]).removeprefix("torch.") for k in names},
        "dtype": str(np_dtype(dtypes[names[0]])) if len({dtypes[k] for k in names}) == 1 else None,
        "count": n,
        "planned": planned,
        "batch_size": batch_size,
    }
    run["np_dtypes"] = {k: str(np_dtype(dtypes[k])) for k in names}
    try:
        create_arrays(out, run)
    except OSError as e:
        raise ExtractError(f"cannot create the feature files in {out}: {e}") from None


def _run_shard(
    out: Path,
    run: dict[str, Any],
    runner: Runner,
    dataset: Any,
    collate: Callable[..., Any],
    loader_kw: dict[str, Any],
    index: np.ndarray,
    journal: Journal,
    key: dict[str, Any],
    done: int,
    skipped: list[dict[str, Any]],
    *,
    batch_size: int,
    num_workers: int,
    mine: list[int],
    plan: np.ndarray | None,
    n: int,
    total: int,
    rows_done: int,
    progress: bool,
    on_error: str,
) -> None:
    """Extract the global batches ``mine[done:]`` of this process's shard."""
    arrays = open_arrays(out, run)
    np_dtypes = {k: np.dtype(v) for k, v in run["np_dtypes"].items()}
    fill = {k: (np.nan if d.kind in "fc" else 0) for k, d in np_dtypes.items()}
    writer = Writer(
        out,
        arrays,
        journal,
        key,
        done=done,
        skipped=skipped,
        fill=fill,
        total=total,
        rows_done=rows_done,
    )
    batches = Batches(mine[done:], batch_size, n, plan)
    kw = dict(loader_kw)
    if runner.device.type == "cuda" and "pin_memory" not in kw:
        kw["pin_memory"] = True
    loader = DataLoader(
        SafeDataset(dataset),
        batch_sampler=batches,
        collate_fn=SafeCollate(collate),
        num_workers=num_workers,
        **kw,
    )
    bar = progress_bar(total, initial=rows_done, enabled=progress, desc="extract", unit="samples")
    try:
        with torch.inference_mode():
            for batch in loader:
                now_skipped: list[dict[str, Any]] = []
                if batch.failed:
                    if on_error == "raise":
                        writer.close()  # what came before is durable
                        i, why = batch.failed[0]
                        raise sample_error(index, i, why)
                    now_skipped = [
                        {"row": i, "id": index[i].item(), "reason": r} for i, r in batch.failed
                    ]
                feats = runner(batch.data) if batch.good else {}
                good = None if not batch.failed else batch.good
                rows = None if plan is None else batch.indices  # dataset indices
                writer.put(
                    WriteItem(batch.indices[0], len(batch.indices), good, feats, now_skipped, rows)
                )
                bar.update(len(batch.indices))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        arrays.clear()  # unmap (the writer shares this dict)


def _finish(
    out: Path,
    run: dict[str, Any],
    model: nn.Module,
    index: np.ndarray,
    pool: str,
    batch_size: int,
    plan: np.ndarray | None,
    nb: int,
) -> None:
    """Rank 0, after every process finished: check the journals, write index and manifest."""
    from .._version import __version__

    done, skipped = done_batches(out, run["fingerprint"])
    if len(done) != nb:
        raise ExtractError(
            f"{nb - len(done)} of {nb} batches were not finished by their process; run the "
            "extraction again"
        )
    n = run["count"]
    not_extracted: list[int] = []
    if plan is not None:  # rows no sampler chose: filled (NaN, 0 for integers), marked invalid
        chosen = np.zeros(n, dtype=bool)
        chosen[plan] = True
        not_extracted = np.flatnonzero(~chosen).tolist()
        arrays = open_arrays(out, run)
        for arr in arrays.values():
            arr[not_extracted] = np.nan if arr.dtype.kind in "fc" else 0
            arr.flush()
        arrays.clear()
    save_index(out, index)
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
        "valid": n - len(skipped) - len(not_extracted),
        "batch_size": batch_size,
        "index": INDEX,
        "index_kind": "path" if index.dtype.kind == "U" else "dataset_index",
        "skipped": skipped,
        "skipped_rows_hold": "nan (0 for integer dtypes)",
        "not_extracted": not_extracted,
        "versions": {
            "hookscope": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
    }
    atomic_write_json(out / MANIFEST, manifest)
    shutil.rmtree(state_dir(out), ignore_errors=True)
