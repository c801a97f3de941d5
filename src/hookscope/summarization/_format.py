"""Text formatting of summary cells: numbers, shapes, column choice, truncation to a width."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from ..core._nested import format_shapes
from ._rows import SummaryRow

__all__ = [
    "COLUMNS",
    "DEFAULT_COLUMNS",
    "HEAD",
    "RIGHT",
    "cell",
    "clip",
    "fmt_bytes",
    "fmt_int",
    "fmt_si",
    "parse_columns",
    "shrink",
]

COLUMNS = ("type", "input", "output", "params", "trainable", "flops", "time", "bytes")
"""Columns a summary can show (the layer name is always the first one)."""
DEFAULT_COLUMNS = ("type", "output", "params", "flops", "time")


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_si(n: float, unit: str = "") -> str:
    """``1234567 -> '1.23M'``."""
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suf}{unit}"
    return f"{n:g}{unit}"


def fmt_bytes(n: int) -> str:
    """``1536 -> '1.50 KiB'``."""
    for div, suf in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return f"{n} B"


HEAD = {
    "name": "Layer",
    "type": "Type",
    "input": "Input shape",
    "output": "Output shape",
    "params": "Params",
    "trainable": "Trainable",
    "flops": "FLOPs",
    "time": "Time ms",
    "bytes": "Out bytes",
}
RIGHT = {"params", "trainable", "flops", "time", "bytes"}


def cell(row: SummaryRow, col: str) -> str:
    if col == "type":
        return row.type
    if col == "input":
        return format_shapes(row.input_shapes)
    if col == "output":
        return format_shapes(row.output_shapes)
    if col == "params":
        return (fmt_int(row.params) + ("*" if row.shared_params else "")) if row.params else "--"
    if col == "trainable":
        return (
            (fmt_int(row.trainable) + ("*" if row.shared_params else "")) if row.trainable else "--"
        )
    if col == "flops":
        return fmt_si(row.flops) if row.flops else "--"
    if col == "time":
        return f"{row.time_ms:.3f}"
    if col == "bytes":
        return fmt_bytes(row.output_bytes)
    raise KeyError(col)


def clip(text: str, width: int, ell: str, keep_right: bool = False) -> str:
    if len(text) <= width:
        return text
    if keep_right:  # a name: keep its indentation and its most specific (rightmost) part
        indent = len(text) - len(text.lstrip(" "))
        body = text[indent:]
        room = max(1, width - indent - len(ell))
        return (" " * indent + ell + body[-room:])[:width]
    return text[: max(0, width - len(ell))] + ell


def shrink(widths: list[int], cols: list[str], budget: int) -> None:
    """Narrow the flexible columns until the row fits ``budget``: shapes and type first, the layer
    name last (it is what users copy into ``capture``)."""
    stages = [
        ("input", 16),
        ("type", 12),
        ("output", 16),
        ("name", 28),
        ("input", 10),
        ("output", 10),
        ("type", 8),
        ("name", 12),
        ("input", 6),
        ("output", 6),
        ("type", 6),
        ("name", 8),
    ]
    for col, floor in stages:
        if col not in cols:
            continue
        i = cols.index(col)
        excess = sum(widths) - budget
        if excess <= 0:
            return
        widths[i] = max(min(widths[i], floor), widths[i] - excess)


def parse_columns(columns: str | Sequence[str] | None) -> tuple[str, ...]:
    if columns is None:
        return DEFAULT_COLUMNS
    if isinstance(columns, str):
        if columns == "all":
            return COLUMNS
        columns = [c.strip() for c in columns.split(",") if c.strip()]
    for c in columns:
        if c not in COLUMNS:
            close = difflib.get_close_matches(str(c), COLUMNS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown summary column {c!r}; {hint}valid columns: {', '.join(COLUMNS)} (or 'all')"
            )
    return tuple(columns)
