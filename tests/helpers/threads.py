"""A model whose forward runs a block in a worker thread it starts and waits on (the calls a
scope's own thread does not make, yet are part of its forward: see docs/guide/core.md,
Threads)."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn


class Worker(nn.Module):
    """a -> b = [Linear, Tanh] in a thread named ``thread`` (and, with ``both``, once more in
    the calling thread) -> c."""

    def __init__(self, thread: str = "worker of the forward", both: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 2)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.thread, self.both = thread, both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = self.a(x), {}
        t = threading.Thread(target=lambda: out.__setitem__("h", self.b(h)), name=self.thread)
        t.start()
        t.join()
        h = out["h"]
        if self.both:
            h = self.b(h)
        return self.c(h)
