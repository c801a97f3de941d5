"""The data of a model summary (:class:`SummaryRow`, :class:`SummaryTotals`, :class:`Summary`) and
its renderings: a plain table fitting a width (ASCII fallback), rich, HTML, dict and JSON."""

from __future__ import annotations

import dataclasses
import html
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COLUMNS", "DEFAULT_COLUMNS", "Summary", "SummaryRow", "SummaryTotals"]

COLUMNS = ("type", "input", "output", "params", "trainable", "flops", "time", "bytes")
"""Columns a summary can show (the layer name is always the first one)."""
DEFAULT_COLUMNS = ("type", "output", "params", "flops", "time")


@dataclass
class SummaryRow:
    """One call of one module, in call order (a module called 3 times has 3 rows).

    ``input_shapes`` keys are positional paths (``"0"``, ``"1.h"``) and keyword names
    (``"attention_mask"``); ``output_shapes`` keys are paths into the output (``""`` for a bare
    tensor, ``"0"``, ``"last_hidden_state"``). ``params``/``trainable`` count the module's own and
    its children's parameters; ``shared_params`` of those were already counted by an earlier row
    that is not an ancestor (tied weights, a repeated call): totals count them once. ``flops`` are
    the FLOPs of operators run by this call itself, not inside a child row (so rows sum to the
    total); ``time_ms`` is inclusive of children.
    """

    name: str
    type: str
    depth: int
    call: int
    calls: int
    input_shapes: dict[str, list[int]]
    output_shapes: dict[str, list[int]]
    params: int
    trainable: int
    shared_params: int
    flops: int
    time_ms: float
    output_bytes: int
    leaf: bool

    @property
    def label(self) -> str:
        """The name as shown: ``<root>`` for the model, ``relu#2`` for a module's second call."""
        base = self.name or "<root>"
        return f"{base}#{self.call + 1}" if self.calls > 1 else base


@dataclass
class SummaryTotals:
    """Totals of a summary. Parameters are counted once each, however many modules share them.

    ``activation_bytes`` sums the outputs of innermost rows; ``peak_memory_bytes`` is the extra
    memory the forward needed at its peak (``peak_memory_measure`` says how it was measured).
    """

    params: int
    trainable: int
    flops: int
    param_bytes: int
    buffer_bytes: int
    activation_bytes: int
    peak_memory_bytes: int
    peak_memory_measure: str
    time_ms: float
    device: str


def _fmt_int(n: int) -> str:
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


def _shape(s: list[int]) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def fmt_inputs(shapes: dict[str, list[int]]) -> str:
    parts = []
    for k, s in shapes.items():
        if k[:1].isdigit():
            parts.append(_shape(s) if "." not in k else f"{k}:{_shape(s)}")
        else:
            parts.append(f"{k}={_shape(s)}")
    return ", ".join(parts) or "-"


def fmt_outputs(shapes: dict[str, list[int]]) -> str:
    if list(shapes) == [""]:
        return _shape(shapes[""])
    return ", ".join(f"{k}:{_shape(s)}" for k, s in shapes.items()) or "-"


_HEAD = {
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
_RIGHT = {"params", "trainable", "flops", "time", "bytes"}
_FLEX = ("name", "output", "input", "type")  # shrunk (truncated) in this order of preference


def _cell(row: SummaryRow, col: str) -> str:
    if col == "type":
        return row.type
    if col == "input":
        return fmt_inputs(row.input_shapes)
    if col == "output":
        return fmt_outputs(row.output_shapes)
    if col == "params":
        return (_fmt_int(row.params) + ("*" if row.shared_params else "")) if row.params else "--"
    if col == "trainable":
        return (
            (_fmt_int(row.trainable) + ("*" if row.shared_params else ""))
            if row.trainable
            else "--"
        )
    if col == "flops":
        return fmt_si(row.flops) if row.flops else "--"
    if col == "time":
        return f"{row.time_ms:.3f}"
    if col == "bytes":
        return fmt_bytes(row.output_bytes)
    raise KeyError(col)


def _clip(text: str, width: int, ell: str, keep_right: bool = False) -> str:
    if len(text) <= width:
        return text
    if keep_right:  # a name: keep its indentation and its most specific (rightmost) part
        indent = len(text) - len(text.lstrip(" "))
        body = text[indent:]
        room = max(1, width - indent - len(ell))
        return (" " * indent + ell + body[-room:])[:width]
    return text[: max(0, width - len(ell))] + ell


@dataclass
class Summary:
    """The result of :func:`hookscope.summary`: ``rows``, ``totals`` and renderings.

    ``str(summary)`` is a plain table fitting 100 columns; ``summary.to_text(width=, ascii=,
    columns=)`` chooses; rich renders it as a table (``rich.print(summary)``); notebooks show
    ``_repr_html_``; ``to_dict()``/``to_json()`` give everything as data.
    """

    model: str
    inputs: str
    rows: list[SummaryRow]
    totals: SummaryTotals
    columns: tuple[str, ...] = DEFAULT_COLUMNS
    never_called: list[str] = dataclasses.field(default_factory=list)

    # -- data -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything as plain Python data (JSON-serialisable)."""
        rows = []
        for r in self.rows:
            d = dataclasses.asdict(r)
            d["label"] = r.label
            rows.append(d)
        return {
            "model": self.model,
            "inputs": self.inputs,
            "columns": list(self.columns),
            "rows": rows,
            "totals": dataclasses.asdict(self.totals),
            "never_called": list(self.never_called),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    # -- text -----------------------------------------------------------------------------------
    def _cols(self, columns: Sequence[str] | None) -> list[str]:
        return ["name", *(self.columns if columns is None else columns)]

    def footer(self, *, columns: Sequence[str] | None = None) -> list[str]:
        """The totals as lines of text."""
        t = self.totals
        cols = self._cols(columns)
        lines = [
            f"Params: {_fmt_int(t.params)} ({fmt_bytes(t.param_bytes)}), trainable: {_fmt_int(t.trainable)}, "
            f"non-trainable: {_fmt_int(t.params - t.trainable)}; buffers: {fmt_bytes(t.buffer_bytes)}",
            f"Forward FLOPs: {_fmt_int(t.flops)} ({fmt_si(t.flops)}; FlopCounterMode formulas, multiply-add = 2)",
            f"Activations: {fmt_bytes(t.activation_bytes)} (outputs of innermost layers)",
            f"Peak memory of the forward: {fmt_bytes(t.peak_memory_bytes)} ({t.peak_memory_measure})",
        ]
        if "time" in cols:
            lines.append(
                f"Time: {t.time_ms:.3f} ms (one forward on {t.device}, hooks and FLOP counting on)"
            )
        if any(r.shared_params for r in self.rows) and ({"params", "trainable"} & set(cols)):
            lines.append(
                "* includes parameters already counted in an earlier row (shared, tied or called again)"
            )
        if any(r.calls > 1 for r in self.rows):
            lines.append("#n: the n-th call of a module called several times")
        if self.never_called:
            shown = ", ".join(self.never_called[:4]) + (
                " ..." if len(self.never_called) > 4 else ""
            )
            lines.append(
                f"Never called through __call__ ({len(self.never_called)}; counted in their parent): {shown}"
            )
        return lines

    def to_text(
        self, width: int = 100, *, ascii: bool | None = None, columns: Sequence[str] | None = None
    ) -> str:
        """A plain-text table at most ``width`` characters wide.

        ``ascii=None`` uses box-drawing characters only when ``sys.stdout`` can encode them.
        """
        if ascii is None:
            enc = getattr(sys.stdout, "encoding", None) or "ascii"
            try:
                "─…".encode(enc)
                ascii = False
            except (UnicodeEncodeError, LookupError):
                ascii = True
        rule_ch, ell = ("-", "...") if ascii else ("─", "…")
        cols = self._cols(columns)
        cells = [[_HEAD[c] for c in cols]]
        for r in self.rows:
            cells.append([" " * r.depth + r.label if c == "name" else _cell(r, c) for c in cols])
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        gap = 2
        _shrink(widths, cols, width - gap * (len(cols) - 1))
        out = []
        title = f"{self.model} summary, input {self.inputs}"
        out.append(_clip(title, width, ell))
        total_w = sum(widths) + gap * (len(cols) - 1)
        rule = rule_ch * total_w
        for i, row in enumerate(cells):
            parts = []
            for j, (c, text) in enumerate(zip(cols, row)):
                text = _clip(text, widths[j], ell, keep_right=(c == "name" and i > 0))
                parts.append(text.rjust(widths[j]) if c in _RIGHT else text.ljust(widths[j]))
            out.append((" " * gap).join(parts).rstrip())
            if i == 0:
                out.append(rule)
        out.append(rule)
        out.extend(_clip(line, width, ell) for line in self.footer(columns=columns))
        text = "\n".join(out)
        return text.encode("ascii", "replace").decode() if ascii else text

    def __str__(self) -> str:
        return self.to_text()

    __repr__ = __str__

    # -- rich and HTML --------------------------------------------------------------------------
    def __rich__(self) -> Any:
        from rich.table import Table

        cols = self._cols(None)
        table = Table(
            title=f"{self.model} summary, input {self.inputs}",
            caption="\n".join(self.footer()),
            caption_justify="left",
        )
        for c in cols:
            table.add_column(_HEAD[c], justify="right" if c in _RIGHT else "left", overflow="fold")
        for r in self.rows:
            table.add_row(*[" " * r.depth + r.label if c == "name" else _cell(r, c) for c in cols])
        return table

    def _repr_html_(self) -> str:
        cols = self._cols(None)
        e: Callable[[str], str] = html.escape
        head = "".join(
            f"<th style='text-align:{'right' if c in _RIGHT else 'left'}'>{e(_HEAD[c])}</th>"
            for c in cols
        )
        body = []
        for r in self.rows:
            tds = []
            for c in cols:
                if c == "name":
                    text = "&nbsp;" * (2 * r.depth) + f"<code>{e(r.label)}</code>"
                else:
                    text = e(_cell(r, c))
                tds.append(
                    f"<td style='text-align:{'right' if c in _RIGHT else 'left'}'>{text}</td>"
                )
            body.append("<tr>" + "".join(tds) + "</tr>")
        foot = "<br>".join(e(line) for line in self.footer())
        return (
            f"<div><b>{e(self.model)}</b> summary, input <code>{e(self.inputs)}</code>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p style='font-family:monospace'>{foot}</p></div>"
        )


def _shrink(widths: list[int], cols: list[str], budget: int) -> None:
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
    ]
    for col, floor in stages:
        if col not in cols:
            continue
        i = cols.index(col)
        excess = sum(widths) - budget
        if excess <= 0:
            return
        widths[i] = max(min(widths[i], floor), widths[i] - excess)
