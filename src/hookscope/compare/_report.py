"""The result of :func:`hookscope.compare`: one row per module call, the verdicts, a table, a plot."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ..core._optional import need

__all__ = ["CompareReport", "CompareRow"]


@dataclasses.dataclass
class CompareRow:
    """One module call present in both runs (matched by name and occurrence).

    Errors are norm-wise relative errors (``||b - a|| / ||a||``), ``None`` where there was nothing
    to compare (no gradient in one of the runs, no floating output).

    Attributes:
        name: A's dotted module name (``""`` for the root); ``b_name`` B's when ``names=`` renames.
        index: the occurrence (0 for the module's first call, 1 for the second, ...).
        kind: the module's class name.
        depth: how many calls enclose this one.
        end: the position of this call in the order calls ended (outputs were produced).
        error: B's output against A's, both from the full runs.
        local_error: B's module run on A's own inputs to this call (and A's outputs of the calls
            it makes), against A's output: the error the module adds by itself.
        compile_error: B compiled against B's module run eagerly on the inputs the compiled run
            gave it (``None`` unless B is compiled): what compilation adds inside the module; its
            output and what it hands its children, and with ``loss_fn`` its input gradients from
            the compiled run's output gradient (what the compiled backward adds).
        grad_error: B's gradient of the output against A's.
        local_grad_error: B's vector-Jacobian product at A's inputs with A's output gradient,
            against A's input gradient (and the module's parameter gradients, the same way).
        param_grad_error: the whole runs' ``.grad`` of the module's own parameters, B against A.
        tol: the tolerance the two dtypes give this module (see ``hookscope.compare``).
        flagged: ``"forward"``, ``"backward"`` or ``"compiled"`` when the module's own
            computation adds error beyond ``tol`` there; ``None`` otherwise.
        note: why an error beyond ``tol`` is not flagged, or what could not be done.
    """

    name: str
    index: int
    kind: str
    depth: int
    end: int
    error: float | None = None
    local_error: float | None = None
    compile_error: float | None = None
    grad_error: float | None = None
    local_grad_error: float | None = None
    param_grad_error: float | None = None
    tol: float = 0.0
    flagged: str | None = None
    note: str = ""
    b_name: str | None = None

    @property
    def label(self) -> str:
        """``name`` (``<root>`` for ``""``), with ``#index`` for a second or later call."""
        base = self.name or "<root>"
        return base if self.index == 0 else f"{base}#{self.index}"


def _clean(v: Any) -> Any:
    """A float that JSON cannot hold (inf, -inf, nan) as its name."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf"
    return f"{x:.1e}"


_COLUMNS = [
    ("module", "label"),
    ("kind", "kind"),
    ("error", "error"),
    ("local", "local_error"),
    ("compiled", "compile_error"),
    ("grad", "grad_error"),
    ("local grad", "local_grad_error"),
    ("param grad", "param_grad_error"),
    ("tol", "tol"),
    ("flag", "flagged"),
]


@dataclasses.dataclass
class CompareReport:
    """What :func:`hookscope.compare` found.

    Attributes:
        rows: one :class:`CompareRow` per module call present in both runs, in A's call order.
        culprit: the name of the deepest module whose own computation adds error beyond what the
            dtypes explain (the first such in the order calls end), or ``None``.
        culprits: every such module call (none of them encloses another), labels in end order.
        first_divergent: the first module, in the order outputs are produced, whose output
            differs beyond its tolerance, or ``None``. Where the error shows, not where it is
            made: an effect of ``culprit`` or of accumulated rounding.
        unmatched: module calls that ran in only one of the runs: ``"a: name#index"`` or
            ``"b: name#index"``; never paired with another call.
        dtypes: the two runs' compute dtypes (``"float32"``, ``"bfloat16"``; autocast included).
        loss: ``(loss of A, loss of B)`` with ``loss_fn``, else ``None``.
        notes: run-level remarks (e.g. why there is no culprit verdict).
    """

    rows: list[CompareRow]
    culprit: str | None
    culprits: list[str]
    first_divergent: str | None
    unmatched: list[str]
    dtypes: tuple[str, str]
    loss: tuple[float, float] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def row(self, name: str, index: int = 0) -> CompareRow:
        """The row of call ``index`` of module ``name``."""
        for r in self.rows:
            if r.name == name and r.index == index:
                return r
        raise KeyError(f"no row for module {name!r} call {index}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data, strict JSON: a value that is not finite (an error or a loss) as the string
        ``"inf"``, ``"-inf"`` or ``"nan"``."""
        rows = [{k: _clean(v) for k, v in dataclasses.asdict(r).items()} for r in self.rows]
        return {
            "culprit": self.culprit,
            "culprits": list(self.culprits),
            "first_divergent": self.first_divergent,
            "unmatched": list(self.unmatched),
            "dtypes": list(self.dtypes),
            "loss": [_clean(v) for v in self.loss] if self.loss else None,
            "notes": list(self.notes),
            "rows": rows,
        }

    def _cells(self) -> list[list[str]]:
        out = []
        for r in self.rows:
            cells = []
            for _, attr in _COLUMNS:
                v = getattr(r, attr)
                if attr == "label":
                    cells.append("  " * r.depth + v)
                elif isinstance(v, float) or (v is None and attr != "flagged"):
                    cells.append(_fmt(v))
                else:
                    cells.append(str(v or ""))
            out.append(cells)
        return out

    def _summary(self) -> str:
        lines = [
            f"compare {self.dtypes[0]} (a) vs {self.dtypes[1]} (b): culprit {self.culprit!r}, "
            f"first divergent {self.first_divergent!r}"
        ]
        if self.loss:
            lines.append(f"loss a {self.loss[0]:.6g}, b {self.loss[1]:.6g}")
        if self.unmatched:
            lines.append("ran in one run only: " + ", ".join(self.unmatched))
        lines += self.notes
        return "\n".join(lines)

    def __str__(self) -> str:
        heads = [h for h, _ in _COLUMNS]
        cells = self._cells()
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
        line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()  # noqa: E731
        body = [line(heads), line(["-" * w for w in widths])] + [line(c) for c in cells]
        return "\n".join(body) + "\n" + self._summary()

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title="hookscope compare")
        for h, _ in _COLUMNS:
            table.add_column(h, justify="left" if h in ("module", "kind", "flag") else "right")
        for r, cells in zip(self.rows, self._cells()):
            table.add_row(*cells, style="bold red" if r.flagged else None)
        return Group(table, Text(self._summary()))

    def plot(self, path: str | os.PathLike[str] | None = None, ax: Any = None) -> Any:
        """Error and local error of every module call along the model (A's call order), on a log
        scale, with each row's tolerance; the culprit marked. Draws into ``ax`` or a new figure
        (Agg canvas, nothing shown); saves a PNG at ``path``; returns the figure."""
        need("matplotlib", "viz", "CompareReport.plot")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        if ax is None:
            fig = Figure(figsize=(max(6.0, 0.25 * len(self.rows) + 2), 4.0))
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
        fig = ax.figure
        xs = list(range(len(self.rows)))
        attrs = ["error", "local_error"]
        if any(r.local_grad_error is not None for r in self.rows):
            attrs.append("local_grad_error")
        drawn = [getattr(r, a) for r in self.rows for a in attrs]
        positive = [v for v in drawn if v is not None and 0 < v < math.inf]
        # zeros (exact rows) sit at the foot of the log axis, below every value drawn, labelled
        # "0"; no value is raised to a floor or cut at a ceiling
        floor = min([1e-12, *positive]) / 10 if positive and min(positive) <= 1e-12 else 1e-12
        marks: dict[int, list[str]] = {}

        def ys(attr: str) -> list[float]:
            out = []
            for i, r in enumerate(self.rows):
                v = getattr(r, attr)
                if v is not None and not 0 < v < math.inf:
                    word = "0" if v == 0 else _fmt(v) if v == math.inf else "NaN"
                    if word not in marks.setdefault(i, []):
                        marks[i].append(word)
                out.append(math.nan if v is None or not v < math.inf else v if v != 0 else floor)
            return out

        ax.semilogy(xs, ys("error"), "o-", ms=3, label="error (full runs)")
        ax.semilogy(xs, ys("local_error"), "s", ms=3, label="local error (replayed on A's inputs)")
        if "local_grad_error" in attrs:
            ax.semilogy(xs, ys("local_grad_error"), "^", ms=3, label="local gradient error")
        for i, words in marks.items():  # not drawable on a log axis: said where they are
            ax.annotate(
                ", ".join(words),
                (i, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=6,
                color="black" if words == ["0"] else "red",
            )
        ax.semilogy(xs, [r.tol for r in self.rows], "k--", lw=0.8, label="tolerance")
        for i, r in enumerate(self.rows):
            if r.flagged and r.label in self.culprits:
                ax.axvline(i, color="red", alpha=0.4)
                ax.annotate(r.label, (i, 1e-1), rotation=90, color="red", fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels([r.label for r in self.rows], rotation=90, fontsize=6)
        ax.set_ylabel("relative error")
        ax.set_title(f"culprit: {self.culprit or 'none'}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        if path is not None:  # written whole or not at all
            target = os.fspath(path)
            tmp = f"{target}.tmp{os.getpid()}"
            fmt = os.path.splitext(target)[1].lstrip(".").lower() or "png"
            try:
                fig.savefig(tmp, dpi=100, format=fmt)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return fig
