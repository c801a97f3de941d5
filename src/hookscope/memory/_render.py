"""Renderings of a :class:`MemoryProfile`: plain text, rich table, matplotlib bar chart."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core._optional import need

if TYPE_CHECKING:
    from ._profile import MemoryProfile, MemoryRow

__all__ = ["fmt_bytes", "plot", "to_rich", "to_text"]

_HEAD = ("layer", "type", "calls", "saved", "saved (total)", "params saved", "fwd FLOPs")


def fmt_bytes(n: int) -> str:
    """``1536 -> '1.50 KiB'``."""
    for div, suf in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return f"{n} B"


def _na(n: int | None, fmt: Any) -> str:
    """A measured value formatted; ``n/a`` for one not measured (``None``: inside a compiled
    region, a compiled model's FLOPs)."""
    return "n/a" if n is None else fmt(n)


def _si(n: int) -> str:
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f}{suf}"
    return str(n)


def _cells(r: MemoryRow, compiled: bool = False) -> tuple[str, ...]:
    label = ("  " * r.depth + (r.name.rsplit(".", 1)[-1] if r.name else "(model)"))[:40]
    saved = _na(r.saved_bytes, fmt_bytes) + (" *" if r.shared else "")
    return (
        label,
        r.type,
        _na(r.calls, str),
        saved,
        _na(r.saved_bytes_total, fmt_bytes),
        "n/a"
        if r.param_saved_bytes is None
        else (fmt_bytes(r.param_saved_bytes) if r.param_saved_bytes else ""),
        "n/a" if compiled else _na(r.flops_total, _si),  # not counted in a compiled model
    )


def _rows(p: MemoryProfile, depth: int | None) -> list[MemoryRow]:
    return [r for r in p.rows if depth is None or r.depth <= depth]


def _footer(p: MemoryProfile) -> list[str]:
    lines = [
        f"saved for backward: {fmt_bytes(p.total_saved_bytes)} ({p.total_saved_bytes:,} bytes, "
        f"unique storages; parameters/buffers apart: {fmt_bytes(p.param_saved_bytes)} of "
        f"{fmt_bytes(p.param_bytes)})"
        + (
            f"; by the loss, after the model: {fmt_bytes(p.loss_saved_bytes)}"
            if p.loss_saved_bytes
            else ""
        ),
        (
            # a compiled model's live and peak bytes and FLOPs are not measured (0 in the fields)
            "live and peak bytes, FLOPs: not measured in a compiled model (the dispatch mode "
            "would change what it compiles); profile the model before compiling it for them"
            if p.per_region
            else f"live at end of forward: {fmt_bytes(p.live_bytes_end_forward)}; peak forward "
            f"{fmt_bytes(p.peak_forward_bytes)}, peak backward "
            + (
                fmt_bytes(p.peak_backward_bytes)
                if p.peak_backward_bytes is not None
                else "not measured (pass backward_peak=True)"
            )
            + " (tensors created in the step)"
        ),
        "* a storage also saved by later modules, counted once, here",
    ]
    if p.per_region:
        lines.append(
            "compiled model: per compiled region (what is saved is the compiled graph's choice; "
            "n/a: a module inside a region, not measured)"
        )
    return lines


def to_text(p: MemoryProfile, *, depth: int | None = None, width: int = 100) -> str:
    if isinstance(width, bool) or not isinstance(width, int):
        raise TypeError(f"MemoryProfile.to_text: width= must be an int, got {width!r}")
    table = [_HEAD, *(_cells(r, p.per_region) for r in _rows(p, depth))]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEAD))]
    narrowest = sum(widths) + 2 * (len(widths) - 1)
    if width < narrowest:  # cutting the lines would cut numbers off, silently
        raise ValueError(
            f"MemoryProfile.to_text: width={width} is narrower than the table ({narrowest} "
            f"characters); use width >= {narrowest}, or a smaller depth= for shorter names"
        )
    out = []
    for i, row in enumerate(table):
        parts = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(parts).rstrip())
        if i == 0:
            out.append("-" * narrowest)
    return "\n".join([f"memory profile of {p.model} (one training step)", *out, *_footer(p)])


def to_rich(p: MemoryProfile) -> Any:
    rich_table = need("rich.table", "cli", "MemoryProfile.__rich__")
    table = rich_table.Table(
        title=f"memory profile of {p.model} (one training step)", caption="\n".join(_footer(p))
    )
    for i, h in enumerate(_HEAD):
        table.add_column(h, justify="left" if i < 2 else "right")
    for r in p.rows:
        table.add_row(*_cells(r, p.per_region))
    return table


def plot(p: MemoryProfile, *, depth: int | None = 1, ax: Any = None) -> Any:
    plt = need("matplotlib.pyplot", "viz", "MemoryProfile.plot()")
    rows = [r for r in _rows(p, depth) if r.name and (r.saved_bytes_total or 0) > 0]
    rows = [
        r
        for r in rows
        if depth is None
        or r.depth == depth
        or not any(s.name.startswith(r.name + ".") for s in rows)
    ]
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(rows) + 1.2))
    else:
        fig = ax.figure
    names = [r.name for r in rows][::-1]
    mib = [r.saved_bytes_total / (1 << 20) for r in rows][::-1]
    ax.barh(names, mib, color=["#d62728" if r.shared else "#1f77b4" for r in rows][::-1])
    ax.set_xlabel("saved for backward (MiB)")
    ax.set_title(f"{p.model}: {fmt_bytes(p.total_saved_bytes)} saved in all")
    fig.tight_layout()
    return fig
