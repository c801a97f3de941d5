"""Where monitor records go: TensorBoard, JSON Lines, Weights & Biases, MLflow, or any callable
``fn(record)``. The trackers are imported when a sink is made, never by ``import hookscope``."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

from ..core._errors import HookscopeWarning
from ..core._optional import need

_F32_MAX = 3.4028234663852886e38
_F32_TINY = 2.0**-149  # float32's smallest positive (subnormal) value

__all__ = ["JsonlSink", "MlflowSink", "TensorBoardSink", "WandbSink", "as_sink"]


class JsonlSink:
    """Append each record as one JSON line (``record.to_dict(histograms=True)``: with a
    record's histograms, ``"histograms": {tag: [bucket_limits, counts]}``) to ``path`` (its
    folder is made if missing, as TensorBoard's writer does).

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
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def __call__(self, record: Any) -> None:
        self._file.write(json.dumps(record.to_dict(histograms=True)) + "\n")
        self._file.flush()

    write = __call__

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardSink:
    """Write scalars ``<stat>/<layer>``, ``param_<stat>/<parameter>``, with a GradScaler
    ``skipped`` (1 for a step it skipped, else 0), and with ``histograms=True`` activation
    histograms computed on the device, to TensorBoard (their ``min``/``max`` are the outer edges
    of the first and last non-empty buckets, which bound the binned values: 0 for a ReLU's).

    ``writer`` is a log directory or a ``torch.utils.tensorboard.SummaryWriter`` (then it is not
    closed by the sink). NaN and inf are written as they are; TensorBoard stores float32, so a
    finite value beyond its range becomes inf (a warning says so), and a nonzero one below it
    (magnitude 2**-150 or less, e.g. a tiny ``update_ratio``) is written as float32's smallest,
    +-2**-149, not 0 (a warning says so, once). Needs the ``tensorboard``
    package (``pip install hookscope[tensorboard]``).
    """

    def __init__(self, writer: Any = None, *, histograms: bool = False) -> None:
        self.histograms = histograms
        self._said_under = False  # values below float32's range: said once
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
        scalars = [
            (f"{k}/{layer}", v) for layer, st in record.layers.items() for k, v in st.items()
        ]
        scalars += [(f"param_{k}/{p}", v) for p, st in record.params.items() for k, v in st.items()]
        if record.skipped is not None:  # a step the GradScaler skipped: 1, others 0
            scalars.append(("skipped", float(record.skipped)))
        over = [(tag, v) for tag, v in scalars if math.isfinite(v) and abs(v) > _F32_MAX]
        if over:
            tag, v = over[0]
            warnings.warn(
                f"TensorBoardSink, step {step}: {len(over)} finite value(s) beyond float32's range, "
                f"e.g. {tag} = {v:.3g}, are stored by TensorBoard (float32) as inf; the record "
                "(monitor.records, JsonlSink) holds the values",
                HookscopeWarning,
                stacklevel=2,
            )
        # a nonzero value of magnitude 2**-150 or less is 0 in float32: written as +-2**-149
        under = [(t, v) for t, v in scalars if v != 0 and abs(v) <= _F32_TINY / 2]
        if under:
            if not self._said_under:
                self._said_under = True
                ex = ", ".join(f"{t} = {v:.3g}" for t, v in under[:3])
                warnings.warn(
                    f"TensorBoardSink, step {step}: {len(under)} nonzero value(s) below float32's "
                    f"range, {ex}, would be stored by TensorBoard (float32) as 0; they are written "
                    f"as +-{_F32_TINY:.3g} (float32's smallest), here and at later steps (said "
                    "once); the record (monitor.records, JsonlSink) holds the values",
                    HookscopeWarning,
                    stacklevel=2,
                )
            low = {t: math.copysign(_F32_TINY, v) for t, v in under}
            scalars = [(t, low.get(t, v)) for t, v in scalars]
        for tag, v in scalars:
            w.add_scalar(tag, v, step)
        for tag, (limits, counts) in record.histograms.items():
            layer = tag.partition("/")[2]
            s = record.layers.get(layer, {})
            num = sum(counts)
            if not num or not limits or not (limits[-1] > 0 and math.isfinite(limits[-1])):
                continue
            # the binned values' sums: the layer's statistics, or (several micro-batches: the
            # histogram is the first one's) the record's histogram_sums
            got = getattr(record, "histogram_sums", {}).get(tag)
            if got is None:
                mean, std = s.get("mean", 0.0), s.get("std", 0.0)
                got = (mean * num, std**2 * max(num - 1, 0) + num * mean**2)
            total, squares = got
            if not (math.isfinite(total) and math.isfinite(squares)):
                continue
            # bucket j holds [limits[j-1], limits[j]) (the first from -limits[-1]): the outer
            # edges of the first and last non-empty buckets bound the binned values
            filled = [j for j, c in enumerate(counts) if c]
            lo = limits[filled[0] - 1] if filled[0] else -limits[-1]
            w.add_histogram_raw(
                tag,
                min=lo,
                max=limits[filled[-1]],
                num=num,
                sum=total,
                sum_squares=squares,
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


class WandbSink:
    """Log each record's scalars (:meth:`MonitorRecord.scalars`) to a Weights & Biases run, at
    the record's step (``step_offset`` is added: pass the run's own step counter's start when
    the run logs other values by step too). W&B drops values logged below the run's current
    step; the sink warns when a record would be.

    ``run`` is a ``wandb`` run; by default the active one (``wandb.init()`` first). Needs
    ``pip install 'hookscope[wandb]'``.

    Example:
        >>> import wandb, hookscope as hs
        >>> run = wandb.init(project="my-run")  # doctest: +SKIP
        >>> mon = hs.Monitor(model, every=10, sinks=[hs.WandbSink(run)])  # doctest: +SKIP
    """

    def __init__(self, run: Any = None, *, prefix: str = "hookscope", step_offset: int = 0) -> None:
        wandb = need("wandb", "wandb", "WandbSink")
        run = run if run is not None else wandb.run
        if run is None:
            raise ValueError("WandbSink: no active wandb run; call wandb.init() first or pass run=")
        self.run, self.prefix, self.step_offset = run, prefix, step_offset
        self._said = False

    def __call__(self, record: Any) -> None:
        step = record.step + self.step_offset
        now = getattr(self.run, "step", None)
        if not self._said and isinstance(now, int) and step < now:
            # W&B keeps a run's steps increasing: values logged at an earlier step are dropped
            self._said = True
            warnings.warn(
                f"WandbSink: the record of step {record.step} goes to W&B step {step}, below the "
                f"run's step {now}, and W&B drops values logged at an earlier step: this record "
                "(and any later one below the run's step) is not in the run. Pass "
                f"WandbSink(run, step_offset={now - record.step}) when the run logs its own "
                "values by step, or Monitor(first_step=...) for a resumed run",
                HookscopeWarning,
                stacklevel=2,
            )
        self.run.log(record.scalars(self.prefix), step=step)

    write = __call__


class MlflowSink:
    """Log each record's scalars (:meth:`MonitorRecord.scalars`) as MLflow metrics at the
    record's step, to ``run_id`` or the active run (``mlflow.start_run()`` first). NaN and
    +-inf are logged as they are: a file store keeps them; MLflow's database stores keep +-inf as
    +-1.8e308 (a warning says so, once). Needs ``pip install 'hookscope[mlflow]'``.

    Example:
        >>> import mlflow, hookscope as hs
        >>> with mlflow.start_run():  # doctest: +SKIP
        ...     mon = hs.Monitor(model, every=10, sinks=[hs.MlflowSink()])
    """

    def __init__(self, run_id: str | None = None, *, prefix: str = "hookscope") -> None:
        self._mlflow = need("mlflow", "mlflow", "MlflowSink")
        if run_id is None:
            active = self._mlflow.active_run()
            if active is None:
                raise ValueError(
                    "MlflowSink: no active MLflow run; call mlflow.start_run() first or pass run_id="
                )
            run_id = active.info.run_id
        self.run_id, self.prefix = run_id, prefix
        self._said = False

    def __call__(self, record: Any) -> None:
        vals = record.scalars(self.prefix)
        if not self._said:
            infs = [k for k, v in vals.items() if math.isinf(v)]
            uri = str(self._mlflow.get_tracking_uri())
            if infs and not (uri.startswith("file:") or "://" not in uri):
                self._said = True
                warnings.warn(
                    f"MlflowSink, step {record.step}: {len(infs)} infinite value(s), e.g. "
                    f"{infs[0]}, go to the tracking store {uri!r}; MLflow's database stores keep "
                    "+-inf as +-1.8e308 (the record, monitor.records or a JsonlSink, holds inf)",
                    HookscopeWarning,
                    stacklevel=2,
                )
        self._mlflow.log_metrics(vals, step=record.step, run_id=self.run_id, synchronous=True)

    write = __call__


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
