"""Gradient-flow plot: per-layer gradient norms over the monitor's records, as a PNG."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["plot_grad_flow"]


def plot_grad_flow(
    records: Sequence[Any],
    path: str | os.PathLike[str] | None = None,
    *,
    source: Literal["params", "layers"] = "params",
    stat: str = "grad_norm",
) -> Any:
    """Bar chart of ``stat`` per layer (model order, log scale): mean over records and max.

    Args:
        records: :class:`MonitorRecord` objects (e.g. ``list(monitor.records)``).
        path: where to save a PNG (default: not saved).
        source: ``"params"`` plots parameter gradients, ``"layers"`` gradients w.r.t. layer
            outputs.
        stat: the statistic plotted (``"grad_norm"``, or another one the records hold).

    Returns the matplotlib ``Figure`` (Agg canvas, no display needed).

    Example:
        >>> import hookscope as hs
        >>> recs = [hs.MonitorRecord(0, params={"a.weight": {"grad_norm": 1.0}, "b.weight": {"grad_norm": 1e-3}})]
        >>> fig = hs.plot_grad_flow(recs)
        >>> fig.axes[0].get_yscale()
        'log'
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_grad_flow needs matplotlib: pip install 'hookscope[viz]'") from e
    if source not in ("params", "layers"):
        raise ValueError(f"source must be 'params' or 'layers', got {source!r}")
    names: list[str] = []
    values: dict[str, list[float]] = {}
    for rec in records:
        for name, stats in getattr(rec, source).items():
            v = stats.get(stat)
            if v is None or not math.isfinite(v):
                continue
            if name not in values:
                names.append(name)
                values[name] = []
            values[name].append(v)
    if not names:
        raise ValueError(
            f"no finite {stat!r} in the {len(records)} record(s) given (source={source!r})"
        )
    floor = 1e-12
    means = [max(sum(values[n]) / len(values[n]), floor) for n in names]
    maxes = [max(max(values[n]), floor) for n in names]
    fig = Figure(figsize=(max(6.0, 0.25 * len(names) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(names)))
    ax.bar(xs, maxes, color="tab:cyan", alpha=0.6, label=f"max {stat}")
    ax.bar(xs, means, color="tab:blue", alpha=0.9, label=f"mean {stat}")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_xlim(-0.75, len(names) - 0.25)
    ax.set_ylabel(stat)
    steps = [r.step for r in records]
    ax.set_title(f"gradient flow ({source}, steps {min(steps)}-{max(steps)})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), format="png", dpi=100)
    return fig
