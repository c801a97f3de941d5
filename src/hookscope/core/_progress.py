"""Progress bars for loops over data, from tqdm: a widget in Jupyter, a bar on a terminal.

``tqdm.auto`` picks the notebook widget inside a Jupyter kernel and the text bar elsewhere;
``disable=None`` makes the text bar draw only when its stream (stderr) is a terminal, so logs,
pipes and CI output get nothing. ``enabled=False`` (a feature's ``progress=False``) turns it off.
"""

from __future__ import annotations

from typing import Any

from ._optional import need

__all__ = ["progress_bar"]


def progress_bar(
    total: int,
    *,
    desc: str,
    unit: str,
    initial: int = 0,
    enabled: bool = True,
    leave: bool = True,
) -> Any:
    """A ``tqdm`` bar over ``total`` items (``initial`` already done, e.g. a resumed run).

    Use ``bar.update(n)`` and ``bar.close()`` (or ``with``). Nothing is drawn when ``enabled`` is
    false, or outside a notebook when stderr is not a terminal.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()  # not a terminal: stays silent
        >>> with contextlib.redirect_stderr(err), progress_bar(10, desc="extract", unit="samples") as bar:
        ...     bar.update(10)
        >>> err.getvalue()
        ''
    """
    # imported here (tqdm.auto decides notebook vs terminal when first imported), and through
    # need(): core imports no third-party package directly (pyproject's import contract)
    tqdm = need("tqdm.auto", "all", "a progress bar").tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        leave=leave,
        disable=None if enabled else True,
        dynamic_ncols=True,
    )
