"""Loading the batches of :func:`hookscope.extract`: bad samples caught in the workers, global batches.

``dataset[i]`` runs inside ``DataLoader`` workers wrapped by :class:`SafeDataset`, so a file that does
not decode becomes a :class:`Failed` record instead of killing the loader; :class:`SafeCollate`
collates the samples that loaded with the user's ``collate_fn`` and keeps the failures aside.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler
from torch.utils.data._utils.collate import default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin

from ._digest import batch_digest, signature
from ._featstore import ExtractError
from ._imagefolder import ImageFolder

__all__ = [
    "Batch",
    "Batches",
    "Failed",
    "SafeCollate",
    "SafeDataset",
    "as_dataset",
    "collate_error",
    "sampled_rows",
    "reason",
    "sample_error",
    "sample_index",
    "sample_name",
]


class Failed:
    """A sample that could not be used: ``what`` happened (``"could not be loaded"``, ``"cannot be
    batched"``), ``reason`` says why (recorded in the manifest's ``skipped`` list)."""

    __slots__ = ("reason", "what")

    def __init__(self, reason: str, what: str = "could not be loaded") -> None:
        self.reason, self.what = reason, what


def reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class SafeDataset(Dataset):
    """``(i, sample)``, or ``(i, Failed(reason))`` when ``dataset[i]`` raises."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        try:
            return i, self.dataset[i]
        except Exception as e:
            return i, Failed(reason(e))


class Batch:
    """A collated batch: ``data`` holds the samples at positions ``good`` of ``indices``;
    ``failed`` the others; ``digest`` hashes what the model reads (:func:`batch_digest`);
    ``error`` is set when ``collate_fn`` failed for a reason no single sample explains."""

    __slots__ = ("data", "digest", "error", "failed", "good", "indices")

    def __init__(
        self,
        indices: list[int],
        good: list[int],
        data: Any,
        failed: list[tuple[int, Failed]],
        error: str | None = None,
    ) -> None:
        self.indices, self.good, self.data, self.failed = indices, good, data, failed
        self.error = error
        self.digest = "" if error else batch_digest(data, indices, [i for i, _ in failed])

    def pin_memory(self) -> Batch:
        self.data = _pin(self.data)
        return self


class SafeCollate:
    """Collate the samples that loaded with the user's ``collate_fn``; keep the failures aside.

    When ``collate_fn`` fails, the samples whose structure differs from ``reference`` (the
    :func:`signature` of the run's first sample) are set aside as "cannot be batched" and the others
    collated again; a failure no sample explains is returned as the batch's ``error``. (Runs in the
    ``DataLoader`` workers, which is where the batch's digest is computed too.)"""

    def __init__(self, collate: Callable[[list[Any]], Any], reference: str | None = None) -> None:
        self.collate, self.reference = collate, reference

    def __call__(self, items: list[tuple[int, Any]]) -> Batch:
        indices = [i for i, _ in items]
        failed = [(i, s) for i, s in items if isinstance(s, Failed)]
        good = [k for k, (_, s) in enumerate(items) if not isinstance(s, Failed)]
        batch, first = self._collate(items, good, failed)
        if batch is not None:
            return batch
        sigs = {k: signature(items[k][1]) for k in good}
        ref = self.reference
        if ref is None:  # the structure most samples of the batch share
            ref = max(set(sigs.values()), key=list(sigs.values()).count)
        odd = [k for k in good if sigs[k] != ref]
        if odd:
            for k in odd:
                failed.append(
                    (
                        indices[k],
                        Failed(f"it is {sigs[k]} where the samples are {ref}", "cannot be batched"),
                    )
                )
            failed.sort(key=lambda f: f[0])
            good = [k for k in good if k not in odd]
            batch, first = self._collate(items, good, failed)
            if batch is not None:
                return batch
        return Batch(indices, good, None, failed, error=first)

    def _collate(
        self, items: list[tuple[int, Any]], good: list[int], failed: list[tuple[int, Failed]]
    ) -> tuple[Batch | None, str]:
        """The batch of the samples at positions ``good`` (none left: a batch without data), or
        ``None`` and why ``collate_fn`` failed."""
        indices = [i for i, _ in items]
        if not good:
            return Batch(indices, good, None, failed), ""
        try:
            return Batch(indices, good, self.collate([items[k][1] for k in good]), failed), ""
        except Exception as e:
            return None, reason(e)


class Batches:
    """Batch sampler over the global batches ``ks``: batch ``k`` is positions ``[k*B, (k+1)*B)`` of
    the plan (the dataset indices to extract, ascending; ``None``: every index ``0 .. n-1``)."""

    def __init__(
        self, ks: list[int], batch_size: int, n: int, plan: np.ndarray | None = None
    ) -> None:
        self.ks, self.batch_size, self.plan = ks, batch_size, plan
        self.n = n if plan is None else len(plan)

    def __len__(self) -> int:
        return len(self.ks)

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        for k in self.ks:
            if self.plan is None:
                yield list(range(k * b, min(self.n, (k + 1) * b)))
            else:
                yield self.plan[k * b : (k + 1) * b].tolist()


def sampled_rows(data: Any, n: int) -> np.ndarray | None:
    """The dataset indices a ``DataLoader``'s sampler yields (ascending, each once), or ``None``
    when that is every index (a sequential or random permutation sampler, or no DataLoader).

    A ``DistributedSampler`` gives the union of what it yields on every replica (its number of
    replicas and its rank may differ from this run's: hookscope shards the rows itself, so a run
    can resume with another world size). Extraction order does not matter: rows land at their
    dataset index.
    """
    if not isinstance(data, DataLoader) or isinstance(data.sampler, SequentialSampler):
        return None
    sampler = data.sampler
    try:
        from torch.utils.data.distributed import DistributedSampler
    except Exception:  # pragma: no cover - torch without distributed
        DistributedSampler = ()  # type: ignore[assignment,misc]
    if isinstance(sampler, DistributedSampler):
        seen: set[int] = set()
        for r in range(sampler.num_replicas):
            part = copy.copy(sampler)
            part.rank = r
            seen.update(int(i) for i in part)
    else:
        seen = {int(i) for i in sampler}
    rows = np.array(sorted(seen), dtype=np.int64)
    if len(rows) and (rows[0] < 0 or rows[-1] >= n):
        bad = int(rows[0]) if rows[0] < 0 else int(rows[-1])
        raise ValueError(
            f"the DataLoader's {type(sampler).__name__} yields index {bad}, outside the dataset "
            f"(0 .. {n - 1})"
        )
    return None if len(rows) == n else rows


def as_dataset(
    data: Any, batch_size: int, num_workers: int
) -> tuple[Any, int, int, Callable[..., Any], dict[str, Any]]:
    """``(dataset, batch_size, num_workers, collate_fn, other DataLoader options)``."""
    if isinstance(data, (str, os.PathLike)):
        return ImageFolder(data), batch_size, num_workers, default_collate, {}
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise TypeError(
                "extract needs a map-style dataset (len + indexing) so that runs can resume; got an IterableDataset"
            )
        if data.batch_size is None:
            raise ValueError(
                "extract needs a DataLoader with a batch_size (not a custom batch_sampler); or pass the dataset"
            )
        kw: dict[str, Any] = {
            "pin_memory": data.pin_memory,
            "worker_init_fn": data.worker_init_fn,
            "timeout": data.timeout,
        }
        if data.num_workers > 0:
            kw["multiprocessing_context"] = data.multiprocessing_context
            kw["prefetch_factor"] = data.prefetch_factor
        return data.dataset, data.batch_size, data.num_workers, data.collate_fn, kw
    if isinstance(data, IterableDataset):
        raise TypeError(
            "extract needs a map-style dataset (len + indexing) so that runs can resume; got an IterableDataset"
        )
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"data must be a Dataset (len + indexing), a DataLoader or an image folder path; got {type(data).__name__}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return data, batch_size, num_workers, default_collate, {}


def sample_index(dataset: Any) -> np.ndarray:
    """One id per sample: ``sample_id(i)`` or ``samples[i][0]`` (file paths) if known, else ``i``."""
    n = len(dataset)
    sid = getattr(dataset, "sample_id", None)
    if callable(sid):
        return np.array([str(sid(i)) for i in range(n)], dtype=str)
    samples = getattr(dataset, "samples", None)
    if (
        isinstance(samples, list)
        and len(samples) == n
        and samples
        and isinstance(samples[0], tuple)
        and isinstance(samples[0][0], str)
    ):
        root = getattr(dataset, "root", None)
        paths = [s[0] for s in samples]
        if root is not None:
            paths = [os.path.relpath(p, root) for p in paths]
        return np.array(paths, dtype=str)
    return np.arange(n, dtype=np.int64)


def collate_error(index: np.ndarray, batch: Batch) -> ExtractError:
    """``collate_fn`` failed on a batch although every sample has the run's structure."""
    first, last = batch.indices[0], batch.indices[-1]
    return ExtractError(
        f"collate_fn failed on the batch of {sample_name(index, first)} .. {last}: {batch.error}; "
        "every sample has the structure of the first one, so fix the collate_fn"
    )


def sample_name(index: np.ndarray, i: int) -> str:
    return f"sample {i}" if index.dtype.kind in "iu" else f"sample {i} ({index[i]})"


def sample_error(
    index: np.ndarray, i: int, reason: str, what: str = "could not be loaded"
) -> ExtractError:
    err = ExtractError(
        f"{sample_name(index, i)} {what}: {reason}; fix or remove it, or use on_error='skip' "
        "(CLI: --on-error skip) to record it in the manifest and go on"
    )
    err.sample = i  # type: ignore[attr-defined]
    return err
