"""One run of :func:`hookscope.extract` as a job object: the facts resolved once, the steps in order.

:class:`Source` holds the data side (dataset, collate function, loader options, batch size,
sample ids, the sampler's rows); :class:`Job` the model side (layers, pooling, device, the run's
fingerprint, the output folder, this process's rank) and runs the steps: own the folder
(:mod:`._lock`), return a finished run after checking its data, or prepare the files (rank 0),
extract this process's shard, and finish (rank 0). Steps only rank 0 runs go through
:meth:`Job.on_rank0`, which hands rank 0's error to every rank so that no rank waits forever.

Batches are global (``k * batch_size ...``) and each process takes a contiguous block of those
not done yet, so every batch is the same whatever the number of processes or interruptions.
Each batch's digest (a hash of what the model read, :func:`._digest.batch_digest`) is journaled
with it; a resume re-reads the finished batches (all, or a spread with ``verify="sample"``) and
refuses to go on if one reads differently.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ..core._buffers import INTERNALS, plain_attributes, state_kept
from ..core._errors import HookscopeWarning, some_names
from ..core._progress import progress_bar
from ..core._random import random_draws, training_modules
from ..core._scope import model_device
from ..core._sharded import fsdp1_found, is_dtensor
from ._data import (
    Batches,
    SafeCollate,
    SafeDataset,
    as_dataset,
    collate_error,
    reason,
    sample_error,
    sample_index,
    sample_name,
    sampled_rows,
)
from ._digest import callable_identity, hash_code, signature
from ._featstore import (
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    ExtractError,
    Journal,
    WriteItem,
    Writer,
    atomic_write_json,
    consolidate,
    create_arrays,
    done_batches,
    layer_files,
    open_arrays,
    read_json,
    read_run,
    save_index,
    state_dir,
)
from ._forward import Pool, Prepared, Runner, host, np_dtype, pool_fn
from ._lock import OutputLock

__all__ = ["Job", "Options", "SkippedSamplesWarning", "Source", "fingerprint_changes"]

_SAMPLE = 8  # batches re-read by verify="sample"


class SkippedSamplesWarning(HookscopeWarning):
    """``extract(on_error="skip")`` skipped samples; their rows hold NaN (``Features.valid``)."""


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_local_forward(model: nn.Module, world: int) -> None:
    """Refuse, on every rank alike, a model whose forward communicates across ranks: each rank of
    an extraction runs its own batches (and rank 0 a probe alone), so such a forward would wait
    for ranks that never join it (a hang, or collectives paired with the wrong ones)."""
    sharded = [n for n, p in model.named_parameters() if is_dtensor(p)]
    fsdp1 = fsdp1_found(model)
    if sharded or fsdp1:
        names = sharded or fsdp1
        raise ExtractError(
            f"extract on {world} ranks: the model's parameters are sharded across the ranks "
            f"({names[0]!r}{' and others' if len(names) > 1 else ''}: FSDP, tensor parallel), "
            "so its forward gathers them from every rank, while each rank extracts its own "
            "batches (and rank 0 probes the model alone): it would wait for ranks that never "
            "join it. Extract with an unsharded model on each rank (load the full state dict, "
            "e.g. torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True)), into a plain copy), or in one process"
        )
    ddp_cls = nn.parallel.DistributedDataParallel
    for name, m in model.named_modules():
        if isinstance(m, ddp_cls) and m.broadcast_buffers and any(True for _ in m.buffers()):
            where = f"{name!r}" if name else "the model"
            raise ExtractError(
                f"extract on {world} ranks: {where} is a DistributedDataParallel with buffers "
                "and broadcast_buffers=True, so each of its forward calls broadcasts them from "
                "rank 0 to every rank, while each rank extracts its own batches (and rank 0 "
                "probes the model alone): it would wait for ranks that never join it. Pass the "
                "module inside it (ddp.module: the same weights, no communication; its layer "
                "names drop the 'module.' prefix)"
            )


def _model_name(model: nn.Module) -> str:
    """``package.module.Class``; for a model loaded from a file (CLI ``path.py:Name``) ``path.py:Class``,
    stable across processes (the module name the loader invents is not)."""
    cls = type(model)
    mod = sys.modules.get(cls.__module__)
    if cls.__module__.startswith("_hookscope_user_") and getattr(mod, "__file__", None):
        return f"{Path(mod.__file__).name}:{cls.__qualname__}"  # type: ignore[union-attr, arg-type]
    return f"{cls.__module__}.{cls.__qualname__}"


def _weights(model: nn.Module) -> str:
    """Every value of every parameter and buffer (their bytes' CRC-32: about 4 GB/s here, so a
    changed value anywhere, one unit ablated, changes the fingerprint; ~64 sampled values per
    tensor missed such changes and a resume mixed two models' features), device-independent."""
    h = hashlib.sha256()
    state = model.state_dict()
    # non-persistent buffers too (a mask, a rotary table): the forward reads them as well
    extra = {f"~{k}": v for k, v in model.named_buffers() if k not in state and v is not None}
    for k, v in (*state.items(), *extra.items()):
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}:".encode())
        if not v.numel() or v.is_meta:
            continue
        for data in _tensor_bytes(v.detach().cpu()):
            h.update(zlib.crc32(data).to_bytes(4, "little"))
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> list[np.ndarray]:
    """Every value of ``t`` as bytes: a quantized tensor's integers and the values they stand
    for (its integers alone missed a scale changed), a sparse tensor's dense values (its bytes
    cannot be viewed)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        parts = [t.int_repr(), t.dequantize()]
    else:
        parts = [t]
    return [p.contiguous().reshape(-1).view(torch.uint8).numpy() for p in parts]


_SETTING = (bool, int, float, str, type(None))


def _setting(v: Any) -> bool:
    """A PyTorch module's setting: a number, a string, ``None`` or a tuple of them (a kernel size)."""
    if v.__class__ is tuple:
        return all(x.__class__ in _SETTING for x in v)
    return v.__class__ in _SETTING


def _attributes(model: nn.Module) -> str:
    """The attributes a forward reads beside the weights, which change the features: the float
    and string attributes of the model's own module classes (a temperature, a scale, a mode;
    their ints and bools are left out: a forward changes those itself, a call counter, a flag
    set once, and a resume must not read that as another run), and every setting of PyTorch's
    modules (``LeakyReLU.negative_slope``, ``BatchNorm.eps``, ``Softmax.dim``: they never change
    them in a forward, and a change between a run and its resume mixed two models' features)."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        if type(m).__module__.startswith("torch."):
            plain = {
                k: v
                for k, v in m.__dict__.items()
                if k not in INTERNALS and k != "training" and _setting(v)
            }
        else:
            plain = {
                k: v
                for k, v in plain_attributes(m.__dict__).items()
                if v.__class__ in (float, str) and k != "training"
            }
        if plain:
            h.update(f"{name}:{sorted(plain.items(), key=lambda kv: kv[0])!r};".encode())
    return h.hexdigest()


def _autocast(device: torch.device) -> str | None:
    """The autocast the forward runs under on ``device`` (``"cpu bfloat16"``), or None: an
    ``extract`` called inside ``torch.autocast`` computes its layers in that dtype, other
    features than a run without it (bf16: ~1e-2 apart), so a resume must not mix the two."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return f"{kind} {str(torch.get_autocast_dtype(kind)).removeprefix('torch.')}"
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None


def _code_of(model: nn.Module) -> str:
    """The ``forward`` code of every module class in ``model`` (a changed model class changes it)."""
    h = hashlib.sha256()
    for cls in sorted(
        {type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)
    ):
        h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        fwd = getattr(cls.forward, "__code__", None)
        if fwd is not None:
            hash_code(h, fwd)
    return h.hexdigest()


# the version of what a run's fingerprint covers (see Job._fields): a folder written under
# another one is named as such, not as a run whose model changed
FINGERPRINT_SCHEME = 2

# the fields of a run's fingerprint, as messages name them; those shown with their values
_FIELDS = {
    "model": "model class",
    "weights": "model weights",
    "attributes": "model attributes (settings of its modules: LeakyReLU's slope, a temperature)",
    "code": "model code (a forward changed)",
    "layers": "layers",
    "pool": "pool",
    "pool_code": "pool function (code, defaults or closure values)",
    "dtype": "dtype",
    "autocast": "autocast",
    "count": "number of samples",
    "batch_size": "batch size",
    "index": "sample ids (dataset or file list)",
    "rows": "rows the DataLoader's sampler chose",
}
_SHOWN = ("model", "layers", "pool", "dtype", "autocast", "count", "batch_size")


def _saved_as(layer: str, got: torch.dtype, want: torch.dtype) -> torch.dtype:
    """The dtype a layer's features are saved in for ``dtype=want``: ``want``, or, for a layer
    whose values are complex (an FFT), the complex dtype of ``want``'s precision (a cast to a
    real dtype drops the imaginary part: float32 asked, complex64 saved); numpy has no complex
    float16, so ``want=torch.float16`` is refused there, naming the layer and the choices."""
    if not got.is_complex:
        return want
    if want == torch.float64:
        return torch.complex128
    if want == torch.float32:
        return torch.complex64
    raise ExtractError(
        f"extract: layer {layer!r} gives {str(got).removeprefix('torch.')} values, and "
        f"dtype={want} would drop their imaginary part (numpy has no complex "
        f"{str(want).removeprefix('torch.')}); pass "
        "dtype=torch.float32 (saved as complex64) or dtype=None, or a pool that makes them real "
        "(pool=lambda t, name: t.abs())"
    )


def fingerprint_changes(before: Any, now: dict[str, Any]) -> str:
    """What differs between an earlier run's fingerprint fields and this run's, for a message:
    ``"dtype (float16 there, float32 here) and batch size (64 there, 32 here)"``.

    >>> fingerprint_changes({"dtype": "None", "batch_size": 64}, {"dtype": "torch.float16", "batch_size": 64})
    'dtype (None there, torch.float16 here)'
    """
    if not isinstance(before, dict):  # written by a hookscope that did not keep them
        return (
            "model, its weights, layers, pool, dtype, batch size or data (the folder does not say "
            "which)"
        )
    if before.get("scheme") != now.get("scheme"):
        return (
            "fingerprint (the folder was written by another hookscope version, whose fingerprint "
            "covers other settings: its run cannot be checked against this one)"
        )
    parts = []
    for key, what in _FIELDS.items():
        a, b = before.get(key), now.get(key)
        if a == b:
            continue
        parts.append(f"{what} ({a} there, {b} here)" if key in _SHOWN else what)
    if not parts:
        return "settings this hookscope does not know (the folder was written by another version)"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package: the code that called extract."""
    here = str(Path(__file__).parent)
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(here):
        f, level = f.f_back, level + 1
    return level


def _warn_dropped(dropped: dict[str, str]) -> None:
    """Say which layers return several tensors, of which extract saves only the first."""
    first = next(iter(dropped))
    more = f" (and {some_names(list(dropped)[1:])} likewise)" if len(dropped) > 1 else ""
    warnings.warn(
        f"extract: layer {first!r} returns {dropped[first]}{more}, and extract saves only the "
        "first tensor of a layer's output; the others are not in the files. Select the modules "
        "that return the tensors you want (one layer each), or call hs.FeatureExtractor, "
        "which returns the whole output",
        HookscopeWarning,
        stacklevel=_caller_level(),
    )


def _warn_channels_first(found: dict[str, tuple[str, tuple[int, ...]]], pool: str) -> None:
    """Say which layers give a channels-first 3-D output that pool "avg"/"max" reduces over
    its channels (axis 1, the token rule of (batch, tokens, dim)), not over its length."""
    first = next(iter(found))
    cls, shape = found[first]
    more = f" (and {some_names(list(found)[1:])} likewise)" if len(found) > 1 else ""
    op = "mean" if pool == "avg" else "amax"
    warnings.warn(
        f"extract: layer {first!r} ({cls}) gives (batch, {shape[1]}, {shape[2]}): (batch, "
        f"channels, length){more}; "
        f"pool={pool!r} reduces axis 1 of a 3-D output, as for the tokens of (batch, tokens, "
        f"dim), so each row holds {shape[2]} values, its {shape[1]} channels reduced at each "
        f"position. For one value per channel over the length, pass pool=lambda t: t.{op}(-1)",
        HookscopeWarning,
        stacklevel=_caller_level(),
    )


@dataclass(frozen=True)
class Options:
    """What the caller asked for, beyond the model, the data and the layers."""

    dtype: torch.dtype | None = None
    device: torch.device | None = None
    resume: bool = True
    progress: bool = True
    on_error: str = "raise"
    verify: str = "all"


@dataclass
class Source:
    """The data of a run, resolved once from ``data``."""

    dataset: Any
    collate: Callable[..., Any]
    loader_kw: dict[str, Any]
    batch_size: int
    num_workers: int
    index: np.ndarray  # one sample id per dataset index
    plan: np.ndarray | None  # the dataset indices a sampler chose (None: all)

    @classmethod
    def of(cls, data: Any, batch_size: int, num_workers: int) -> Source:
        dataset, batch_size, num_workers, collate, kw = as_dataset(data, batch_size, num_workers)
        if len(dataset) == 0:
            raise ExtractError("the dataset is empty: nothing to extract")
        plan = sampled_rows(data, len(dataset))
        if plan is not None and len(plan) == 0:
            raise ExtractError("the DataLoader's sampler yields no sample: nothing to extract")
        return cls(dataset, collate, kw, batch_size, num_workers, sample_index(dataset), plan)

    @property
    def n(self) -> int:
        return len(self.index)

    @property
    def planned(self) -> int:
        """Rows to extract: every sample, or those the sampler chose."""
        return self.n if self.plan is None else len(self.plan)

    @property
    def batches(self) -> int:
        return -(-self.planned // self.batch_size)

    def rows_of(self, ks: list[int]) -> int:
        b = self.batch_size
        return sum(min(self.planned, (k + 1) * b) - k * b for k in ks)

    def loader(
        self, ks: list[int], reference: str | None, pin: bool, lock: OutputLock
    ) -> DataLoader:
        """The global batches ``ks``, in this order, loaded with the bad samples set aside (the
        workers drop their inherited copy of ``lock``: it dies with its owner)."""
        kw = dict(self.loader_kw)
        if pin and "pin_memory" not in kw:
            kw["pin_memory"] = True
        if self.num_workers > 0:
            kw["worker_init_fn"] = lock.worker_init(kw.get("worker_init_fn"))
        return DataLoader(
            SafeDataset(self.dataset),
            batch_sampler=Batches(ks, self.batch_size, self.n, self.plan),
            collate_fn=SafeCollate(self.collate, reference),
            num_workers=self.num_workers,
            **kw,
        )

    def probe_order(self) -> Any:
        return range(self.n) if self.plan is None else self.plan.tolist()


@dataclass
class Job:
    """One extraction: the model resolved once (layers, pooling, device), the data, the folder."""

    out: Path
    model: nn.Module
    named: dict[str, nn.Module]
    pool: Pool
    source: Source
    options: Options
    rank: int = field(init=False)
    world: int = field(init=False)
    fingerprint: str = field(init=False)
    lock: OutputLock = field(init=False)

    def __post_init__(self) -> None:
        self.pooling, self.pool_name = pool_fn(self.pool)
        self.names = list(self.named)
        self.rank, self.world = _dist()
        if self.world > 1:
            _check_local_forward(self.model, self.world)
        self.lock = OutputLock(self.out)
        self.fields = self._fields()
        self.fingerprint = hashlib.sha256(
            json.dumps(self.fields, sort_keys=True).encode()
        ).hexdigest()[:24]
        self.checked_draws = False  # this process's first forward was checked for random draws

    def _fields(self) -> dict[str, Any]:
        """What the run's fingerprint hashes (kept in the folder: a refusal names what changed)."""
        src = self.source
        desc = {
            "model": _model_name(self.model),
            "weights": _weights(self.model),
            "attributes": _attributes(self.model),
            "code": _code_of(self.model),
            "layers": self.names,
            "pool": self.pool_name,
            "pool_code": callable_identity(self.pool) if callable(self.pool) else None,
            "dtype": str(self.options.dtype),
            "count": src.n,
            "batch_size": src.batch_size,
            "index": hashlib.sha256(src.index.tobytes()).hexdigest(),
            # what the fingerprint covers, by hookscope version (2: PyTorch modules' settings,
            # non-persistent buffers, a pool's globals): a folder of another scheme is named so
            "scheme": FINGERPRINT_SCHEME,
        }
        if src.plan is not None:  # a sampler chose the rows
            desc["rows"] = hashlib.sha256(src.plan.tobytes()).hexdigest()
        cast = _autocast(self.options.device or model_device(self.model))
        if cast is not None:  # (absent when off: the fingerprints of earlier folders hold)
            desc["autocast"] = cast
        return desc

    # -- the steps -----------------------------------------------------------------------------------
    def run(self) -> None:
        """Own ``out``, then return a finished run (checked) or extract what is left."""
        self.on_rank0(self._own)
        try:
            if self.on_rank0(self._finished):
                return
            with Prepared(self.model, self.options.device) as run_dev:
                runner = Runner(self.model, self.named, self.pooling, run_dev, self.pool_name)
                self.on_rank0(lambda: self._prepare(runner))
                run = read_run(self.out)
                if run is None or run["fingerprint"] != self.fingerprint:
                    raise ExtractError(
                        f"{self.out}: the extraction state written by rank 0 is missing or differs"
                    )
                runner.dtypes = {k: getattr(torch, v) for k, v in run["dtypes"].items()}
                self._shard(runner, run)
            self._barrier()
            self.on_rank0(lambda: self._finish(run))
        finally:
            self.lock.release()  # rank 0's; a no-op elsewhere

    def on_rank0(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` on rank 0 alone; every rank gets its result, or raises its error."""
        if self.world == 1:
            return step()
        import torch.distributed as dist

        msg = [None, None]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                msg[1] = step()
            except Exception as e:
                error, msg[0] = e, str(e) if isinstance(e, ExtractError) else f"rank 0: {reason(e)}"
        dist.broadcast_object_list(msg, src=0)
        if error is not None:
            raise error
        if msg[0] is not None:
            raise ExtractError(msg[0])
        return msg[1]

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _own(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ExtractError(f"cannot create the output directory {self.out}: {e}") from None
        self.lock.acquire()

    def _finished(self) -> bool:
        """Rank 0: ``True`` (lock released) if ``out`` holds this run, finished, on the same data."""
        manifest = read_json(self.out / MANIFEST) if self.options.resume else None
        if manifest is None:
            return False
        if manifest.get("fingerprint") != self.fingerprint:
            changed = fingerprint_changes(manifest.get("fingerprint_fields"), self.fields)
            raise ExtractError(
                f"{self.out} already holds a finished extraction of another run (its {changed} "
                "differ from this call's); choose another output directory, or pass "
                "resume=False (CLI: --no-resume) to overwrite it"
            )
        digests = manifest.get("batch_digests")
        if digests is None:
            warnings.warn(
                f"extract: {self.out} was written by a hookscope that did not record what each "
                "batch read, so the data cannot be checked against it; pass resume=False "
                "(CLI: --no-resume) to recompute if the data or transform changed",
                HookscopeWarning,
                stacklevel=4,
            )
        else:
            self._verify(
                dict(enumerate(digests)),
                manifest.get("sample_signature"),
                self._spread(len(digests)),
            )
        shutil.rmtree(state_dir(self.out), ignore_errors=True)
        self.lock.release()
        return True

    def _spread(self, count: int) -> list[int]:
        """The finished batches a resume re-reads: all, or a spread of them (``verify="sample"``)."""
        if self.options.verify == "all" or count <= _SAMPLE:
            return list(range(count))
        return sorted({int(k) for k in np.linspace(0, count - 1, _SAMPLE)})

    def _verify(self, digests: dict[int, str], reference: str | None, ks: list[int]) -> None:
        """Re-read the batches ``ks`` (no forward pass) and compare what they read with ``digests``."""
        loader = self.source.loader(ks, reference, False, self.lock)
        for k, batch in zip(ks, loader):
            self._check(k, batch.digest, digests[k])

    def _check(self, k: int, got: str, want: str) -> None:
        if got == want:
            return
        src = self.source
        first = k * src.batch_size
        last = min(src.planned, first + src.batch_size) - 1
        raise ExtractError(
            f"{self.out}: the data differ from what the earlier run read (batch {k}, rows "
            f"{first} .. {last}: another dataset, transform or sample order); its features would "
            "be stale or mixed: pass resume=False (CLI: --no-resume) to recompute, or choose "
            "another output directory"
        )

    def _prepare(self, runner: Runner) -> None:
        """Rank 0: validate an unfinished run in ``out`` and fold its journals into ``done.json``
        (so that any number of processes can share out what is left), or create a new one."""
        out, src = self.out, self.source
        run = read_run(out) if self.options.resume else None
        if run is not None:
            if run.get("fingerprint") != self.fingerprint:
                changed = fingerprint_changes(run.get("fingerprint_fields"), self.fields)
                raise ExtractError(
                    f"{out} holds an unfinished extraction of another run (its {changed} differ "
                    "from this call's); re-run that one to finish it, choose another output "
                    "directory, or pass resume=False (CLI: --no-resume) to start over"
                )
            consolidate(out, self.fingerprint)
            return
        # starting over: the files an earlier run here wrote (its manifest's, its run.json's)
        # go, or a layer this run does not extract would keep the earlier run's features
        earlier: set[str] = set()
        for old in (read_json(out / MANIFEST), read_run(out)):
            if isinstance(old, dict) and isinstance(old.get("files"), dict):
                earlier.update(str(f) for f in old["files"].values())
        (out / MANIFEST).unlink(missing_ok=True)
        # the probe's forward leaves no trace on the model (a counter, a table it builds lazily)
        with torch.no_grad(), state_kept(self.model):
            probed, ref = self._probe(runner)
        want = self.options.dtype
        dtypes = {
            k: (
                _saved_as(k, d, want)
                if want is not None
                else (torch.float32 if d == torch.bfloat16 else d)
            )
            for k, (_, d) in probed.items()
        }
        names = self.names
        run = {
            "fingerprint": self.fingerprint,
            "fingerprint_fields": self.fields,
            "model": _model_name(self.model),
            "layers": names,
            "files": layer_files(names),
            "shapes": {k: list(probed[k][0]) for k in names},
            "dtypes": {k: str(dtypes[k]).removeprefix("torch.") for k in names},
            "dtype": str(np_dtype(dtypes[names[0]]))
            if len({dtypes[k] for k in names}) == 1
            else None,
            "np_dtypes": {k: str(np_dtype(dtypes[k])) for k in names},
            "count": src.n,
            "planned": src.planned,
            "batch_size": src.batch_size,
            "sample_signature": ref,
        }
        try:
            create_arrays(out, run)
        except OSError as e:
            raise ExtractError(f"cannot create the feature files in {out}: {e}") from None
        for fname in earlier - set(run["files"].values()):
            path = out / fname
            if path.parent == out and path.suffix == ".npy":  # (only a file name of ours)
                path.unlink(missing_ok=True)

    def _probe(self, runner: Runner) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], str]:
        """Shapes and dtypes of every layer's rows, and the structure of a sample, from the first
        sample (in extraction order) that loads."""
        src, raise_ = self.source, self.options.on_error == "raise"
        for i in src.probe_order():
            try:
                sample = src.dataset[i]
            except Exception as e:
                if raise_:
                    raise sample_error(src.index, i, reason(e)) from e
                continue
            if sample is None:
                if raise_:
                    raise sample_error(
                        src.index, i, "the dataset returned None", "cannot be batched"
                    )
                continue
            try:
                batch = src.collate([sample])
            except Exception as e:
                raise ExtractError(
                    f"collate_fn fails on {sample_name(src.index, i)} alone "
                    f"({signature(sample)}): {reason(e)}"
                ) from None
            feats = self._forward(runner, batch)
            shapes = {
                k: (tuple(v.shape[1:]), v.dtype)
                for k, v in ((k, host(v)) for k, v in feats.items())
            }
            return shapes, signature(sample)
        raise ExtractError(f"none of the {src.n} samples could be loaded; nothing to extract")

    def _shard(self, runner: Runner, run: dict[str, Any]) -> None:
        """This process's part: re-read its share of the finished batches (checking their digests),
        then extract its share of those not done yet."""
        src, rank, world = self.source, self.rank, self.world
        # the batches not done yet (by a run of any world size), shared out in contiguous blocks
        finished, _ = done_batches(self.out, self.fingerprint, journals=False)  # same on every rank
        todo = [k for k in range(src.batches) if k not in finished]
        mine = todo[rank * len(todo) // world : (rank + 1) * len(todo) // world]
        check = [sorted(finished)[j] for j in self._spread(len(finished))]
        check = check[rank * len(check) // world : (rank + 1) * len(check) // world]
        key = {"fingerprint": self.fingerprint, "rank": rank, "world_size": world, "batches": mine}
        journal = Journal(self.out, rank, key)
        done = journal.done  # 0 unless killed since the consolidation
        show = self.options.progress and rank == 0
        if finished and show:
            print(
                f"hookscope extract: resuming {self.out}: {src.rows_of(sorted(finished))} of "
                f"{src.planned} samples already on disk",
                file=sys.stderr,
            )
        arrays = open_arrays(self.out, run)
        fill = {k: (np.nan if np.dtype(d).kind in "fc" else 0) for k, d in run["np_dtypes"].items()}
        writer = Writer(self.out, arrays, journal, fill)
        ks = check + mine[done:]
        pin = runner.device.type == "cuda"
        loader = src.loader(ks, run.get("sample_signature"), pin, self.lock)
        total, rows_done = src.rows_of(mine), src.rows_of(mine[:done])
        bar = progress_bar(total, initial=rows_done, enabled=show, desc="extract", unit="samples")
        try:
            # no_grad, not inference_mode: a tensor the model keeps (a table it builds lazily)
            # must not be an inference tensor, which fails the user's next training step. The
            # model's plain state (a counter, a float it tracks) evolves over the batches as in
            # a hand loop and is put back at the end: the model is left as found, and a resume's
            # fingerprint (its float attributes) is not changed by the run it resumes
            with torch.no_grad(), state_kept(self.model):
                for k, batch in zip(ks, loader):
                    if k in finished:
                        self._check(k, batch.digest, finished[k])
                        continue
                    writer.put(self._item(runner, batch, writer))
                    bar.update(len(batch.indices))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
            arrays.clear()  # unmap (the writer shares this dict)

    def _item(self, runner: Runner, batch: Any, writer: Writer) -> WriteItem:
        """One batch's rows (forward pass), or its bad samples raised (``on_error="raise"``)."""
        index = self.source.index
        if batch.error is not None:
            writer.close()  # what came before is durable
            raise collate_error(index, batch)
        skipped: list[dict[str, Any]] = []
        if batch.failed:
            if self.options.on_error == "raise":
                writer.close()
                i, bad = batch.failed[0]
                raise sample_error(index, i, bad.reason, bad.what)
            skipped = [
                {"row": i, "id": index[i].item(), "reason": f.reason} for i, f in batch.failed
            ]
        feats = self._forward(runner, batch.data) if batch.good else {}
        good = None if not batch.failed else batch.good
        rows = None if self.source.plan is None else batch.indices  # dataset indices
        item = WriteItem(
            batch.indices[0], len(batch.indices), good, feats, skipped, rows, batch.digest
        )
        item.overflow = {k: (v, np_dtype(runner.dtypes[k])) for k, v in runner.overflow.items()}
        return item

    def _forward(self, runner: Runner, data: Any) -> dict[str, Any]:
        """One forward pass; the first of this process is checked for random draws (a stochastic
        forward gives other features at every run, and a resume would mix draws)."""
        if self.checked_draws:
            return runner(data)
        with random_draws(runner.model, data) as draws:
            feats = runner(data)
        self.checked_draws = True
        runner.watch = False
        if runner.dropped:
            _warn_dropped(runner.dropped)
        if runner.channels_first:
            _warn_channels_first(runner.channels_first, self.pool_name)
        if draws.drew:
            modes = ", ".join(map(repr, training_modules(self.model)))
            raise ExtractError(
                "extract: the model draws random numbers in its forward (functional dropout such "
                "as F.dropout(x, p) without training=self.training, which model.eval() does not "
                "turn off; sampling; stochastic depth"
                + (f"; modules in training mode: {modes}" if modes else "")
                + "), so its features differ at every run and a resume would mix draws; make "
                "the forward deterministic in eval mode (pass training=self.training to the "
                "functional dropout) or extract with your own loop"
            )
        return feats

    def _finish(self, run: dict[str, Any]) -> None:
        """Rank 0, after every process finished: check the journals, write index and manifest."""
        from .._version import __version__

        out, src = self.out, self.source
        done, skipped = done_batches(out, run["fingerprint"])
        nb = src.batches
        if len(done) != nb:
            raise ExtractError(
                f"{nb - len(done)} of {nb} batches were not finished by their process; run the "
                "extraction again"
            )
        n = run["count"]
        not_extracted: list[int] = []
        if src.plan is not None:  # rows no sampler chose: filled (NaN, 0 for integers), invalid
            chosen = np.zeros(n, dtype=bool)
            chosen[src.plan] = True
            not_extracted = np.flatnonzero(~chosen).tolist()
            arrays = open_arrays(out, run)
            for arr in arrays.values():
                arr[not_extracted] = np.nan if arr.dtype.kind in "fc" else 0
                arr.flush()
            arrays.clear()
        save_index(out, src.index)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": run["fingerprint"],
            "fingerprint_fields": run.get("fingerprint_fields"),
            "model": run["model"],
            "layers": run["layers"],
            "files": run["files"],
            "shapes": {k: [n, *v] for k, v in run["shapes"].items()},
            "dtype": run["dtype"],
            "dtypes": run["np_dtypes"],
            "pool": self.pool_name,
            "count": n,
            "valid": n - len(skipped) - len(not_extracted),
            "batch_size": src.batch_size,
            "index": INDEX,
            "index_kind": "path" if src.index.dtype.kind == "U" else "dataset_index",
            "skipped": skipped,
            "skipped_rows_hold": "nan (0 for integer dtypes)",
            "not_extracted": not_extracted,
            "batch_digests": [done[k] for k in range(nb)],
            "sample_signature": run.get("sample_signature"),
            "versions": {
                "hookscope": __version__,
                "torch": torch.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }
        atomic_write_json(out / MANIFEST, manifest)
        shutil.rmtree(state_dir(out), ignore_errors=True)
        self.lock.release()
        if skipped:
            some = "; ".join(
                f"{sample_name(src.index, s['row'])}: {s['reason']}" for s in skipped[:3]
            )
            more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            warnings.warn(
                f"extract: {len(skipped)} of {n} samples were skipped (on_error='skip'): {some}{more}; "
                f"their rows in {out} hold NaN (0 for integer dtypes): mask them with Features.valid",
                SkippedSamplesWarning,
                stacklevel=4,
            )
