"""Shared helpers for the benchmarks: interleaved timing, medians, table printing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    contenders: dict[str, Callable[[], object]],
    rounds: int,
    inner: int = 1,
    warmup: int = 2,
    stat: str = "median",
) -> dict[str, float]:
    """Seconds per call of each contender (median, or min over rounds: noise only ever adds time),
    timed A, B, C, B, C, A, C, A, B, ... in one run (interleaved, order rotated each round)."""
    pick = statistics.median if stat == "median" else min
    return {k: pick(v) for k, v in samples(contenders, rounds, inner, warmup).items()}


def samples(
    contenders: dict[str, Callable[[], object]],
    rounds: int,
    inner: int = 1,
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Every round's seconds per call, per contender, timed as :func:`interleaved` times them."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no fixed neighbour
            fn = contenders[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out[name].append((time.perf_counter() - t0) / inner)
    return out


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub-flavoured Markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(headers), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells)]
    )
