"""``Packer``: the statistics of one logged step, read from the device with one transfer.

The hooks of a logged step produce many small statistics vectors (:data:`~._stats.Vec`: float64
tensors on a CUDA device, or lists of floats computed on the host). :meth:`Packer.add` files
each one and returns its *slot*; :meth:`Packer.gather` concatenates them (one ``all_gather``
under torch.distributed) and reads them with one device-to-host transfer; the result is read by
slot, per rank. No statistic is read on the host before that, so the hooks never synchronise.

Example:
    >>> import torch
    >>> p = Packer()
    >>> a, b, n = p.add([1.0, 2.0]), p.add(torch.tensor([3.0], dtype=torch.float64)), p.add_host(7)
    >>> got = p.gather()
    >>> got.read(a), got.read(b), got.read(n), got.world
    ([1.0, 2.0], [3.0], [7.0], 1)
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ._stats import Vec

__all__ = ["Packed", "Packer"]


class Packer:
    """Collects statistics vectors; each :meth:`add` returns the slot to read it back from."""

    def __init__(self) -> None:
        self._parts: list[Vec] = []
        self._hosts: list[float] = []
        # per slot: (is a host value, index in _parts / _hosts)
        self._slots: list[tuple[bool, int]] = []

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, vec: Vec) -> int:
        """File a statistics vector (a device tensor or a list of floats); returns its slot."""
        self._parts.append(vec)
        self._slots.append((False, len(self._parts) - 1))
        return len(self._slots) - 1

    def add_host(self, value: float) -> int:
        """File one number known on the host (e.g. an element count); returns its slot."""
        self._hosts.append(float(value))
        self._slots.append((True, len(self._hosts) - 1))
        return len(self._slots) - 1

    def gather(self, step: int = 0, layout: str = "") -> Packed:
        """Every rank's values, end to end, with one host transfer (see :func:`_gather`).
        Under torch.distributed the ranks' values are joined by position, so every rank must
        file the same statistics of the same step: ``step`` and ``layout`` (what was filed, in
        order: names and counts) are compared across ranks with the vector sizes (no other
        collective), and a difference raises on every rank."""
        sizes = [len(p) if isinstance(p, list) else p.numel() for p in self._parts]
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        host0 = starts[-1]
        spans = [
            (host0 + i, host0 + i + 1) if host else (starts[i], starts[i + 1])
            for host, i in self._slots
        ]
        return Packed(_gather(self._parts, self._hosts, step, layout), spans)


class Packed:
    """The gathered values: :meth:`read` one slot of one rank, :meth:`each` one slot of every rank."""

    __slots__ = ("_ranks", "_spans")

    def __init__(self, ranks: list[list[float]], spans: list[tuple[int, int]]) -> None:
        self._ranks, self._spans = ranks, spans

    @property
    def world(self) -> int:
        """How many ranks' values were gathered (1 without torch.distributed)."""
        return len(self._ranks)

    def read(self, slot: int, rank: int = 0) -> list[float]:
        """The values filed in ``slot`` on ``rank``."""
        a, b = self._spans[slot]
        return self._ranks[rank][a:b]

    def each(self, slot: int) -> list[list[float]]:
        """The values filed in ``slot``, one list per rank."""
        a, b = self._spans[slot]
        return [r[a:b] for r in self._ranks]


def _gather(
    parts: list[Vec], hosts: list[float], step: int = 0, layout: str = ""
) -> list[list[float]]:
    """Every rank's vector, ``parts`` then ``hosts`` end to end (one ``all_gather``, after one of
    each rank's ``[size, step, layout hash]``); just this rank's without torch.distributed.
    Statistics computed on the host (lists) stay Python floats; device tensors are read with one
    transfer."""
    single = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    if single and all(isinstance(p, list) for p in parts):
        return [[v for p in parts for v in p] + hosts]  # type: ignore[union-attr]
    dev = next((p.device for p in parts if isinstance(p, torch.Tensor)), torch.device("cpu"))
    if not single and dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    flat = torch.cat(
        [
            p.reshape(-1).to(dev)
            if isinstance(p, torch.Tensor)
            else torch.tensor(p, dtype=torch.float64, device=dev)
            for p in parts
        ]
        + [torch.tensor(hosts, dtype=torch.float64, device=dev)]
    )
    if single:
        return [flat.tolist()]
    world = dist.get_world_size()
    n = torch.tensor([flat.numel(), step, zlib.crc32(layout.encode())], device=flat.device)
    heads = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(heads, n)
    sizes, steps, layouts = ([int(h[i]) for h in heads] for i in range(3))
    if len(set(steps)) != 1:
        raise RuntimeError(
            f"Monitor: the ranks recorded different steps together (steps {steps} on ranks "
            f"0-{world - 1}): each rank numbers its steps by its own monitor.step() calls, and "
            "the ranks' records are joined in call order, so they would mix different steps. "
            "Call monitor.step() on every rank once per optimizer step, also on a step a rank "
            "skips (a NaN loss, an empty batch), with the same first_step on every rank"
        )
    if len(set(sizes)) != 1 or len(set(layouts)) != 1:
        raise RuntimeError(
            f"Monitor: ranks recorded different layer calls or parameters at step {step} "
            f"(vector sizes {sizes}"
            + (", the same sizes but other names or order" if len(set(sizes)) == 1 else "")
            + "); every rank must run the same monitored layers, in the same order, with the "
            "same micro-batches, and train the same parameters (this rank: "
            f"{layout[:300]})"
        )
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return torch.stack(out).tolist()
