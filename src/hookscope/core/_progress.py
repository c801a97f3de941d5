"""A dependency-free progress line for long loops: count, percent, items/s and ETA on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


def _fmt_time(seconds: float) -> str:
    s = int(seconds + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``label  1,234/50,000  2%  310.2 samples/s  ETA 2:31``, redrawn in place.

    Shown only when ``enabled`` and the stream is a terminal; otherwise every method is a no-op.
    ``done`` is where a resumed run starts: the rate and ETA count only this run's work.

    Example:
        >>> import io
        >>> p = Progress(10, enabled=True, stream=io.StringIO())  # not a TTY: stays silent
        >>> p.update(5); p.close(); p.stream.getvalue()
        ''
    """

    def __init__(
        self,
        total: int,
        *,
        done: int = 0,
        enabled: bool = True,
        label: str = "extract",
        unit: str = "samples",
        stream: TextIO | None = None,
        min_interval: float = 0.25,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled and isatty is not None and isatty())
        self.total, self.done, self.start_done = total, done, done
        self.label, self.unit, self.min_interval = label, unit, min_interval
        self.t0 = time.monotonic()
        self._last = 0.0
        self._width = 0

    def line(self) -> str:
        """The text of the progress line for the current state."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = _fmt_time((self.total - self.done) / rate) if rate > 0 else "?"
        return f"{self.label}  {self.done:,}/{self.total:,}  {pct:3.0f}%  {rate:.1f} {self.unit}/s  ETA {eta}"

    def update(self, n: int) -> None:
        """Count ``n`` more items; redraw at most every ``min_interval`` seconds."""
        self.done += n
        if self.enabled and (
            time.monotonic() - self._last >= self.min_interval or self.done >= self.total
        ):
            self._draw()

    def _draw(self) -> None:
        text = self.line()
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._last = time.monotonic()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False
