"""Does a model draw random numbers in its forward? Asked of the run itself, not of module types.

Dropout called as a function (``F.dropout(x, p, self.training)``, attention dropout inside
``scaled_dot_product_attention``), stochastic depth and sampling layers are invisible to a list of
module types. Every one of them draws from torch's global generators, so a forward that leaves
those generators where it found them drew nothing. Products that compare runs (a patched run
against a clean one, two prompts' activations) check this on their first forward and refuse a
model whose values change from run to run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from ._compiled import named_modules

__all__ = ["RandomDraws", "random_draws", "training_modules"]


class RandomDraws:
    """Set by :func:`random_draws`: ``drew`` is True when the code inside it advanced a global
    generator (the CPU one, or that of any CUDA device already initialised)."""

    __slots__ = ("drew",)

    def __init__(self) -> None:
        self.drew = False


def _states() -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += list(torch.cuda.get_rng_state_all())
    return states


@contextmanager
def random_draws() -> Iterator[RandomDraws]:
    """Note whether the code inside draws random numbers (the generators are not restored: the
    draws happened in a run the caller keeps).

    >>> with random_draws() as d:
    ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5, training=True)
    >>> d.drew
    True
    >>> with random_draws() as d:
    ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5, training=False)
    >>> d.drew
    False
    """
    found = RandomDraws()
    before = _states()
    try:
        yield found
    finally:
        after = _states()
        found.drew = len(after) != len(before) or any(
            not torch.equal(a, b) for a, b in zip(before, after)
        )


def training_modules(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` names of modules in training mode (``""`` is the root), for messages."""
    return [name or "<root>" for name, m in named_modules(model) if m.training][:limit]
