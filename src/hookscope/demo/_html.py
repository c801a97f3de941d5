"""A self-contained HTML report: one file, inline CSS, every picture an inline base64 PNG.

Nothing in the page refers to anything outside it (no scripts, fonts, stylesheets or image
files), so it opens the same from a mail attachment, a CI artifact or ``file://``. All text is
HTML-escaped here; only markup built by this module (and tables from trusted renderers passed as
:class:`Raw`) goes in unescaped.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Figure", "Raw", "Report", "Section", "png_data_uri"]


@dataclass(frozen=True)
class Raw:
    """Markup that is already safe (built by hookscope from escaped text)."""

    markup: str


@dataclass(frozen=True)
class Figure:
    """One picture with a caption. ``image``: a matplotlib figure, PIL image, uint8/float array
    ``(H, W, 3)`` or float tensor ``(3, H, W)`` in [0, 1]. ``scale`` enlarges small images
    (nearest neighbour, so pixels stay crisp); ``tone``: ``"good"``/``"bad"`` colours the caption."""

    image: Any
    caption: str = ""
    scale: int = 1
    tone: str = ""
    width: int | None = None


@dataclass
class Section:
    """A titled part of the report: an intro paragraph, then blocks (text, figures, tables).

    A section whose content does not apply gets ``note`` (shown in place of the content).
    """

    title: str
    intro: str = ""
    blocks: list[Any] = field(default_factory=list)
    note: str = ""
    anchor: str = ""

    def text(self, text: str, *, kind: str = "") -> Section:
        """Add a paragraph; ``kind``: ``""``, ``"finding"``, ``"ok"`` or ``"code"``."""
        self.blocks.append(("text", kind, text))
        return self

    def figures(self, figures: list[Figure], *, columns: int = 0) -> Section:
        """Add a grid of figures (``columns=0``: as many as fit)."""
        self.blocks.append(("figures", columns, list(figures)))
        return self

    def raw(self, markup: Raw) -> Section:
        self.blocks.append(("raw", "", markup))
        return self

    def table(self, header: list[str], rows: list[list[Any]]) -> Section:
        self.blocks.append(("table", header, rows))
        return self


def _to_png_bytes(image: Any, scale: int = 1) -> tuple[bytes, int, int]:
    """PNG bytes, width and height of ``image`` (see :class:`Figure`)."""
    import numpy as np

    if hasattr(image, "savefig"):  # matplotlib figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        if image.canvas is None or not isinstance(image.canvas, FigureCanvasAgg):
            FigureCanvasAgg(image)
        buf = io.BytesIO()
        image.savefig(buf, format="png", dpi=100)
        data = buf.getvalue()
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
        return data, w, h
    from PIL import Image

    if hasattr(image, "detach"):  # torch tensor (3, H, W) or (H, W) in [0, 1]
        t = image.detach().float().cpu().clamp(0, 1)
        if t.ndim == 3:
            t = t.permute(1, 2, 0)
        image = (t.numpy() * 255).round().astype(np.uint8)
    if isinstance(image, np.ndarray):
        arr = image
        if arr.dtype != np.uint8:
            arr = (np.clip(arr, 0, 1) * 255).round().astype(np.uint8)
        image = Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr)
    if not hasattr(image, "save"):
        raise TypeError(f"cannot turn a {type(image).__name__} into a PNG")
    if scale > 1:
        image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), image.width, image.height


def png_data_uri(image: Any, scale: int = 1) -> str:
    """``data:image/png;base64,...`` for a matplotlib figure, PIL image, array or tensor.

    Example:
        >>> import numpy as np
        >>> png_data_uri(np.zeros((2, 2, 3), dtype=np.uint8))[:22]
        'data:image/png;base64,'
    """
    data, _, _ = _to_png_bytes(image, scale)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


_CSS = """
:root { --ink:#1d2330; --muted:#5b6475; --line:#e3e7ee; --bg:#f6f7fb; --card:#fff;
        --accent:#3451b2; --good:#17803d; --bad:#b42318; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { background:linear-gradient(120deg,#1f2a48,#3451b2); color:#fff; padding:28px 40px 22px; }
header h1 { margin:0 0 6px; font-size:26px; font-weight:650; letter-spacing:.2px; }
header p { margin:0; opacity:.88; }
nav { padding:10px 40px; background:#fff; border-bottom:1px solid var(--line); font-size:14px; }
nav a { color:var(--accent); text-decoration:none; margin-right:18px; }
main { max-width:1160px; margin:0 auto; padding:22px 28px 60px; }
section { background:var(--card); border:1px solid var(--line); border-radius:10px;
          padding:18px 24px 20px; margin:0 0 22px; box-shadow:0 1px 2px rgba(20,30,60,.04); }
h2 { margin:0 0 8px; font-size:19px; }
p { margin:6px 0 10px; }
.intro { color:var(--muted); }
.kpis { display:flex; flex-wrap:wrap; gap:12px; margin:4px 0 0; }
.kpi { background:var(--bg); border:1px solid var(--line); border-radius:8px; padding:8px 14px; min-width:130px; }
.kpi b { display:block; font-size:20px; }
.kpi span { color:var(--muted); font-size:12.5px; }
.note { background:#fff8e6; border-left:4px solid #e0a100; padding:8px 12px; border-radius:4px; }
.finding { background:#fdecea; border-left:4px solid var(--bad); padding:8px 12px; border-radius:4px; }
.ok { background:#e9f6ee; border-left:4px solid var(--good); padding:8px 12px; border-radius:4px; }
pre, code { font-family:ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12.5px; }
pre { background:#f1f3f8; padding:10px 12px; border-radius:6px; overflow-x:auto; margin:8px 0; }
.grid { display:grid; gap:14px; grid-template-columns:repeat(auto-fill,minmax(var(--min,170px),1fr)); align-items:start; }
figure { margin:0; text-align:center; }
figure img { max-width:100%; height:auto; border-radius:4px; border:1px solid var(--line); image-rendering:auto; }
figcaption { font-size:13px; color:var(--muted); margin-top:4px; }
figcaption.good { color:var(--good); } figcaption.bad { color:var(--bad); font-weight:600; }
table { border-collapse:collapse; font-size:13px; width:100%; margin:8px 0; }
th, td { border-bottom:1px solid var(--line); padding:4px 8px; vertical-align:top; }
th { background:#f1f3f8; text-align:left; font-weight:600; }
tbody tr:hover { background:#fafbfe; }
.scroll { overflow-x:auto; }
footer { color:var(--muted); font-size:12.5px; text-align:center; margin-top:10px; }
"""


def _slug(text: str, used: set[str]) -> str:
    base = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "section"
    slug, i = base, 2
    while slug in used:
        slug, i = f"{base}-{i}", i + 1
    used.add(slug)
    return slug


class Report:
    """An HTML report being assembled: a header, key numbers, then sections.

    Example:
        >>> import numpy as np
        >>> r = Report("Demo <model>", subtitle="a & b")
        >>> _ = r.section("Pictures").figures([Figure(np.zeros((4, 4, 3), dtype=np.uint8), "x<y")])
        >>> page = r.to_html()
        >>> "Demo &lt;model&gt;" in page and "x&lt;y" in page and "<script" not in page
        True
    """

    def __init__(self, title: str, *, subtitle: str = "") -> None:
        self.title, self.subtitle = title, subtitle
        self.kpis: list[tuple[str, str]] = []
        self.sections: list[Section] = []

    def kpi(self, value: str, label: str) -> None:
        """A key number shown at the top (``value`` large, ``label`` under it)."""
        self.kpis.append((value, label))

    def section(self, title: str, intro: str = "", *, note: str = "") -> Section:
        s = Section(title, intro, note=note)
        self.sections.append(s)
        return s

    # -- rendering -----------------------------------------------------------------------------
    def _block(self, block: tuple[Any, Any, Any]) -> str:
        e = html.escape
        kind, opt, payload = block
        if kind == "text":
            if opt == "code":
                return f"<pre>{e(payload)}</pre>"
            cls = f" class='{opt}'" if opt in ("finding", "ok", "note") else ""
            return f"<p{cls}>{e(payload)}</p>"
        if kind == "raw":
            return f"<div class='scroll'>{payload.markup}</div>"
        if kind == "table":
            head = "".join(f"<th>{e(str(h))}</th>" for h in opt)
            body = "".join(
                "<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in payload
            )
            return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        if kind == "figures":
            items = []
            widest = 0
            for f in payload:
                data, w, h = _to_png_bytes(f.image, f.scale)
                uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
                shown_w = f.width or w
                widest = max(widest, shown_w)
                tone = f" class='{f.tone}'" if f.tone in ("good", "bad") else ""
                cap = f"<figcaption{tone}>{e(f.caption)}</figcaption>" if f.caption else ""
                items.append(
                    f"<figure><img src='{uri}' width='{shown_w}' alt='{e(f.caption or 'figure')}' "
                    f"data-w='{w}' data-h='{h}'>{cap}</figure>"
                )
            cols = f"grid-template-columns:repeat({opt},1fr);" if opt else ""
            return f"<div class='grid' style='--min:{min(widest, 520)}px;{cols}'>{''.join(items)}</div>"
        raise ValueError(f"unknown block kind {kind!r}")

    def to_html(self) -> str:
        """The whole page as one string."""
        e = html.escape
        used: set[str] = set()
        nav, parts = [], []
        for s in self.sections:
            anchor = s.anchor or _slug(s.title, used)
            nav.append(f"<a href='#{anchor}'>{e(s.title)}</a>")
            body = [f"<h2>{e(s.title)}</h2>"]
            if s.intro:
                body.append(f"<p class='intro'>{e(s.intro)}</p>")
            if s.note:
                body.append(f"<p class='note'>{e(s.note)}</p>")
            body += [self._block(b) for b in s.blocks]
            parts.append(f"<section id='{anchor}'>{''.join(body)}</section>")
        kpis = "".join(
            f"<div class='kpi'><b>{e(v)}</b><span>{e(label)}</span></div>" for v, label in self.kpis
        )
        kpi_html = f"<section><div class='kpis'>{kpis}</div></section>" if kpis else ""
        from .._version import __version__

        return (
            "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{e(self.title)}</title><style>{_CSS}</style></head><body>"
            f"<header><h1>{e(self.title)}</h1><p>{e(self.subtitle)}</p></header>"
            f"<nav>{''.join(nav)}</nav><main>{kpi_html}{''.join(parts)}"
            f"<footer>made by hookscope {e(__version__)}: every picture is inline; this file needs nothing else</footer>"
            "</main></body></html>\n"
        )

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the page (UTF-8) atomically: a temporary file renamed into place."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        page = self.to_html()
        try:
            tmp.write_text(page, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:  # a full disk, an interrupt: no partial file left
            tmp.unlink(missing_ok=True)
            raise
        return path
