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

import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._scope import check_model, internal_run
from ..core._select import resolve
from ._featstore import ExtractError, Features, load_features
from ._forward import Pool, np_dtype
from ._job import Job, Options, Source

__all__ = ["extract"]


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
    verify: Literal["all", "sample"] = "all",
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

    ``out`` belongs to one run at a time: the run holds a lock on it (``out/.hookscope-extract.lock``,
    an ``flock`` the system drops when the process dies, even by SIGKILL; under
    ``torch.distributed`` rank 0 holds it for the whole job). A second run on the same folder,
    whichever starts first, fails at once with an :class:`ExtractError` naming the folder and the
    process that owns it, and :func:`load_features` refuses a folder being written.

    A resumed or repeated run is checked against what the earlier one read: each batch's digest (a
    hash of the model's inputs after the dataset's transform and ``collate_fn``) is journaled with
    it, and a resume re-reads the finished batches (without running the model) and compares. Other
    data, another transform or another sample order make it refuse with an :class:`ExtractError`
    (pass ``resume=False`` to recompute, or use another ``out``): the features are never returned
    stale or mixed. A change of model weights (non-persistent buffers included), module settings
    (``LeakyReLU.negative_slope``, ``BatchNorm.eps``, a float of your own modules), layers,
    pooling (a custom ``pool`` function's code, defaults, closure values and the globals it reads,
    an ``nn.Module`` or a function included), dtype, ``torch.autocast`` or batch size is refused
    the same way, the message naming what changed. A forward that draws random numbers (functional dropout, which
    ``model.eval()`` does not turn off) is refused at its first batch: its features would differ
    at every run, and a resume would mix draws.

    What is promised: every sample is computed in the same batch (same neighbours, same position)
    as in an uninterrupted one-process run, whatever the interruptions and the number of
    processes, so the finished files equal that run's within float rounding. They are byte for
    byte identical when every process runs the same kernels: the same device and the same number
    of CPU threads (``torch.get_num_threads()``; ``torchrun`` starts its processes with
    ``OMP_NUM_THREADS=1``), e.g. a run resumed on the same machine with the same settings. A CPU
    kernel's last bits can change with the thread count, so a resume at another thread count may
    differ in the last bit of some values.

    Args:
        model: any ``nn.Module``; run in eval mode under ``torch.no_grad()`` (its modes,
            device, hooks, buffers and plain attributes are left as found; a tensor it builds
            and keeps is a normal one).
        data: a map-style ``Dataset`` whose samples are a tensor, an ``(input, ...)`` tuple (e.g.
            ``(image, label)``) or a dict of model keyword arguments; a ``DataLoader`` (its
            dataset, batch size, workers, ``collate_fn`` and sampler are used: the samples its
            sampler yields are extracted, each written at its dataset index; a
            ``DistributedSampler`` stands for the union of its replicas; rows no sampler chose
            hold NaN and are ``False`` in ``Features.valid``); or the path of an image folder (:class:`ImageFolder`, 224 px).
        layers: layer selectors (names, globs, types, see :func:`find`). A layer called several
            times in one forward pass contributes its first call; a layer returning several
            tensors (a tuple, a dict of levels) contributes its first, and a
            :class:`HookscopeWarning` names the others.
        out: output directory (created if needed).
        batch_size, num_workers: for the ``DataLoader`` built over ``data`` (unless one is given).
        pool: ``None``, ``"avg"``, ``"max"``, ``"flatten"``, ``"cls"`` or ``fn(output) -> (B, ...)``
            (see :data:`Pool`); applied on the model's device before the copy to the host.
        dtype: dtype to save: a floating dtype numpy holds (``torch.float16``,
            ``torch.float32``, ``torch.float64``); default: each layer's own (bfloat16 is saved
            as float32). An integer or bool dtype raises ``TypeError``.
        device: where to run (default: the model's device); the model is moved back after.
        resume: continue an unfinished run in ``out`` (or return a finished one). ``False``
            starts over, overwriting ``out``'s features.
        progress: show a progress bar (samples/s, ETA): tqdm's widget in a Jupyter notebook, a
            bar on stderr when it is a terminal, nothing otherwise. ``False`` turns it off.
        on_error: a sample whose loading raises, or that cannot be batched with the others (a
            wrong shape, ``None``): ``"raise"`` stops with an :class:`ExtractError` naming it and
            its shape against the others' (work done so far is kept); ``"skip"`` records it in the
            manifest's ``skipped`` list, goes on and warns at the end with the count
            (:class:`HookscopeWarning`). A skipped sample's row holds NaN (0 for integer dtypes),
            identical across resumes; ``Features.valid`` masks such rows.
        verify: which finished batches a resume (or a repeated call on a finished run) re-reads
            to check the data: ``"all"`` (the default: never stale, costs loading the finished
            part of the data again, not the forward passes) or ``"sample"`` (up to 8 batches spread
            over the run: catches another dataset or transform, not a change of a few samples).

    Returns:
        :class:`Features` of the finished directory.

    Raises:
        ExtractError: a sample failed (``on_error="raise"``), writing failed (disk full: the work
            so far is kept, re-run to continue), ``out`` holds a different extraction or was
            extracted from other data, another process is writing ``out``, or the model's
            forward draws random numbers.
        TypeError: ``dtype`` is not a floating dtype.

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
    with internal_run():  # a product's own run (see core._scope.internal_run)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if verify not in ("all", "sample"):
            raise ValueError(f"verify must be 'all' or 'sample', got {verify!r}")
        if dtype is not None:
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(
                    f"extract: dtype= must be a floating dtype to store features in (torch.float16 or "
                    f"torch.float32; torch.bfloat16 layers are saved as float32), got {dtype!r}: an "
                    "integer or bool dtype would truncate them (0 for values in (-1, 1), bool: True)"
                )
            np_dtype(dtype)
        check_model(model)
        named = resolve(model, layers)
        source = Source.of(data, batch_size, num_workers)
        opts = Options(
            dtype=dtype,
            device=torch.device(device) if device is not None else None,
            resume=resume,
            progress=progress,
            on_error=on_error,
            verify=verify,
        )
        job = Job(Path(out), model, named, pool, source, opts)
        if job.world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ExtractError(
                f"this process runs under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}) but torch.distributed is "
                "not initialized, so every process would extract everything into the same files: call "
                "torch.distributed.init_process_group('gloo') first (the hookscope CLI does)"
            )
        job.run()
        return load_features(out)
