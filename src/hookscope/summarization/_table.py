"""The result of :func:`hookscope.summary` and its renderings: a plain table fitting a width
(ASCII fallback), rich, HTML, dict and JSON."""

from __future__ import annotations

import dataclasses
import html
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._format import (
    DEFAULT_COLUMNS,
    HEAD,
    RIGHT,
    cell,
    clip,
    fmt_bytes,
    fmt_int,
    fmt_si,
    shrink,
)
from ._rows import SummaryRow, SummaryTotals

__all__ = ["Summary"]


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

    @staticmethod
    def legend(cols: Sequence[str]) -> list[str]:
        """What the columns count: params and time include the children, FLOPs do not."""
        lines = []
        inclusive = [HEAD[c] for c in ("params", "trainable", "time") if c in cols]
        if inclusive:
            lines.append(f"{', '.join(inclusive)}: inclusive (the module and its children)")
        if "flops" in cols:
            lines.append(
                "FLOPs: exclusive (what the row ran itself; rows add up to the total; -- = none)"
            )
        return lines

    def footer(self, *, columns: Sequence[str] | None = None) -> list[str]:
        """The totals as lines of text."""
        t = self.totals
        cols = self._cols(columns)
        lines = [
            f"Params: {fmt_int(t.params)} ({fmt_bytes(t.param_bytes)}), trainable: {fmt_int(t.trainable)}, "
            f"non-trainable: {fmt_int(t.params - t.trainable)}; buffers: {fmt_bytes(t.buffer_bytes)}",
            f"Forward FLOPs: {fmt_int(t.flops)} ({fmt_si(t.flops)}; FlopCounterMode formulas, multiply-add = 2)",
            f"Activations: {fmt_bytes(t.activation_bytes)} (new outputs of innermost layers)",
            f"Peak memory of the forward: {fmt_bytes(t.peak_memory_bytes)} ({t.peak_memory_measure})",
        ]
        lines.extend(self.legend(cols))
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
        """A plain-text table at most ``width`` characters wide (a ``ValueError`` says the
        narrowest width the chosen columns fit in when ``width`` is below it; the title and
        footer lines are cut to ``width`` with an ellipsis).

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
        cells = [[HEAD[c] for c in cols]]
        for r in self.rows:
            cells.append([" " * r.depth + r.label if c == "name" else cell(r, c) for c in cols])
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        gap = 2
        if not isinstance(width, int) or isinstance(width, bool):
            raise TypeError(f"width must be an int (characters), got {width!r}")
        shrink(widths, cols, width - gap * (len(cols) - 1))
        narrowest = sum(widths) + gap * (len(cols) - 1)
        if narrowest > width:
            raise ValueError(
                f"width={width} is narrower than the narrowest table of these columns "
                f"({narrowest} characters, column names cut to their floor); use width >= "
                f"{narrowest} or fewer columns"
            )
        out = []
        title = f"{self.model} summary, input {self.inputs}"
        out.append(clip(title, width, ell))
        total_w = sum(widths) + gap * (len(cols) - 1)
        rule = rule_ch * total_w
        for i, row in enumerate(cells):
            parts = []
            for j, (c, text) in enumerate(zip(cols, row)):
                text = clip(text, widths[j], ell, keep_right=(c == "name" and i > 0))
                parts.append(text.rjust(widths[j]) if c in RIGHT else text.ljust(widths[j]))
            out.append((" " * gap).join(parts).rstrip())
            if i == 0:
                out.append(rule)
        out.append(rule)
        out.extend(clip(line, width, ell) for line in self.footer(columns=columns))
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
            table.add_column(HEAD[c], justify="right" if c in RIGHT else "left", overflow="fold")
        for r in self.rows:
            table.add_row(*[" " * r.depth + r.label if c == "name" else cell(r, c) for c in cols])
        return table

    def _repr_html_(self) -> str:
        cols = self._cols(None)
        e: Callable[[str], str] = html.escape
        head = "".join(
            f"<th style='text-align:{'right' if c in RIGHT else 'left'}'>{e(HEAD[c])}</th>"
            for c in cols
        )
        body = []
        for r in self.rows:
            tds = []
            for c in cols:
                if c == "name":
                    text = "&nbsp;" * (2 * r.depth) + f"<code>{e(r.label)}</code>"
                else:
                    text = e(cell(r, c))
                tds.append(
                    f"<td style='text-align:{'right' if c in RIGHT else 'left'}'>{text}</td>"
                )
            body.append("<tr>" + "".join(tds) + "</tr>")
        foot = "<br>".join(e(line) for line in self.footer())
        return (
            f"<div><b>{e(self.model)}</b> summary, input <code>{e(self.inputs)}</code>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p style='font-family:monospace'>{foot}</p></div>"
        )
