"""Where monitor records go: TensorBoard, JSON Lines, or any callable ``fn(record)``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

__all__ = ["JsonlSink", "TensorBoardSink", "as_sink"]


class JsonlSink:
    """Append each record as one JSON line (``record.to_dict()``) to ``path``.

    Example:
        >>> import tempfile, os, json, hookscope as hs
        >>> path = os.path.join(tempfile.mkdtemp(), "mon.jsonl")
        >>> sink = hs.JsonlSink(path)
        >>> sink(hs.MonitorRecord(step=3, layers={"fc": {"mean": 0.5}}))
        >>> sink.close()
        >>> with open(path) as f:
        ...     json.loads(f.readline())["layers"]
        {'fc': {'mean': 0.5}}
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def __call__(self, record: Any) -> None:
        self._file.write(json.dumps(record.to_dict()) + "\n")
        self._file.flush()

    write = __call__

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardSink:
    """Write scalars ``<stat>/<layer>`` and ``param_<stat>/<parameter>`` (and, with
    ``histograms=True``, activation histograms computed on the device) to TensorBoard.

    ``writer`` is a log directory or a ``torch.utils.tensorboard.SummaryWriter`` (then it is not
    closed by the sink). Needs the ``tensorboard`` package (``pip install hookscope[tensorboard]``).
    """

    def __init__(self, writer: Any = None, *, histograms: bool = False) -> None:
        self.histograms = histograms
        self._own = not hasattr(writer, "add_scalar")
        if self._own:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TensorBoardSink needs the tensorboard package: pip install 'hookscope[tensorboard]'"
                ) from e
            writer = SummaryWriter(log_dir=writer)
        self.writer = writer

    def __call__(self, record: Any) -> None:
        w, step = self.writer, record.step
        for layer, stats in record.layers.items():
            for k, v in stats.items():
                w.add_scalar(f"{k}/{layer}", v, step)
        for pname, stats in record.params.items():
            for k, v in stats.items():
                w.add_scalar(f"param_{k}/{pname}", v, step)
        for tag, (limits, counts) in record.histograms.items():
            layer = tag.partition("/")[2]
            s = record.layers.get(layer, {})
            num = sum(counts)
            if not num or not limits or not (limits[-1] > 0 and math.isfinite(limits[-1])):
                continue
            mean, std = s.get("mean", 0.0), s.get("std", 0.0)
            if not (math.isfinite(mean) and math.isfinite(std)):
                continue
            w.add_histogram_raw(
                tag,
                min=-limits[-1],
                max=limits[-1],
                num=num,
                sum=mean * num,
                sum_squares=std**2 * max(num - 1, 0) + num * mean**2,
                bucket_limits=limits,
                bucket_counts=counts,
                global_step=step,
            )
        for alert in record.alerts:
            w.add_text(f"alerts/{alert.kind}", alert.message, step)
        w.flush()

    write = __call__

    def close(self) -> None:
        if self._own:
            self.writer.close()


def as_sink(obj: Any) -> Callable[[Any], None]:
    """A sink from a sink object, an object with ``write(record)``, or a callable."""
    if callable(obj):
        return obj  # type: ignore[no-any-return]
    write = getattr(obj, "write", None)
    if callable(write):
        return write  # type: ignore[no-any-return]
    raise TypeError(
        f"a monitor sink must be callable as fn(record) or have .write(record); got {type(obj).__name__}"
    )
