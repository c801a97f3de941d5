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

    Returns the matplotlib ``Figure`` (Agg canvas, no display needed). The bars are the finite
    values' mean and max; a layer with NaN or inf values is kept in place and labelled (``NaN x2``,
    red) at its bar; a zero is drawn at the foot of the log axis and labelled ``0``.

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
    odd: dict[str, dict[str, int]] = {}  # non-finite values, counted by kind: shown, not dropped
    for rec in records:
        for name, stats in getattr(rec, source).items():
            v = stats.get(stat)
            if v is None:
                continue
            if name not in values:
                names.append(name)
                values[name] = []
            v = float(v)
            if math.isfinite(v):
                values[name].append(v)
            else:
                kind = "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf")
                odd.setdefault(name, {}).setdefault(kind, 0)
                odd[name][kind] += 1
    if not any(values.values()):
        raise ValueError(
            f"no finite {stat!r} in the {len(records)} record(s) given (source={source!r})"
            + (f"; non-finite in: {', '.join(odd)}" if odd else "")
        )
    negative = [n for n in names if any(v < 0 for v in values[n])]
    if negative:  # a log axis cannot show them: they would vanish from the bars
        raise ValueError(
            f"plot_grad_flow draws on a log scale, and {stat!r} is negative in "
            f"{', '.join(negative[:5])}{' ...' if len(negative) > 5 else ''}; plot a non-negative "
            "statistic (grad_norm, std, absmax, ...)"
        )
    means = [sum(values[n]) / len(values[n]) if values[n] else math.nan for n in names]
    maxes = [max(values[n]) if values[n] else math.nan for n in names]
    # zeros cannot sit on a log scale: drawn one decade below the smallest positive value (or at
    # 1e-12) and labelled "0"; no positive value is raised to a floor
    positive = [v for v in means + maxes if v > 0]
    floor = min([1e-12, *positive]) / 10 if positive and min(positive) <= 1e-12 else 1e-12
    fig = Figure(figsize=(max(6.0, 0.25 * len(names) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(names)))
    ax.bar(
        xs,
        [floor if v == 0 else v for v in maxes],
        color="tab:cyan",
        alpha=0.6,
        label=f"max {stat}",
    )
    ax.bar(
        xs,
        [floor if v == 0 else v for v in means],
        color="tab:blue",
        alpha=0.9,
        label=f"mean {stat}",
    )
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_xlim(-0.75, len(names) - 0.25)
    for i, n in enumerate(names):
        notes = [f"{k} x{c}" for k, c in odd.get(n, {}).items()]
        if values[n] and maxes[i] == 0:
            notes.append("0")
        elif values[n] and means[i] == 0:
            notes.append("mean 0")
        if notes:
            bad = n in odd
            ax.annotate(
                ", ".join(notes),
                (i, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color="red" if bad else "black",
            )
    ax.set_ylabel(stat)
    steps = [r.step for r in records]
    ax.set_title(f"gradient flow ({source}, steps {min(steps)}-{max(steps)})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), format="png", dpi=100)
    return fig
