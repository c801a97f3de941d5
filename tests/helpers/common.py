"""Small helpers used by several test packages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn


def files_of(path: Path) -> dict[str, bytes]:
    """Every file directly in ``path``, by name, with its bytes (to compare two output folders)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@contextmanager
def one_thread() -> Iterator[None]:
    """This process at one intra-op thread: faster for tiny models on a shared machine, and what
    the ranks of :func:`helpers.dist.launch` use (a CPU kernel's last bits depend on the thread
    count, so byte-for-byte comparisons with the ranks need it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mlp6() -> nn.Sequential:
    """A seeded 6 -> 16 -> 16 -> 3 MLP (Tanh, ReLU): the trainers' and the monitor's small net."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
