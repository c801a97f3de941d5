"""Monitor under DistributedDataParallel (gloo, 2 CPU processes on loopback): statistics reduced
across ranks, written once by rank 0, equal to a one-process run on the combined batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from _dist import WORLD, assert_records_close, launch, read_jsonl

STEPS = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 12, 5, generator=g), torch.randn(STEPS, 12, 1, generator=g)


def train(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, out: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, sinks=[hs.JsonlSink(out, append=False)], alerts="off") as mon:
        for x, y in zip(xs, ys):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()


def _worker(rank: int, tmp: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(make_model())
    xs, ys = make_data()
    train(
        ddp,
        xs.chunk(WORLD, dim=1)[rank],
        ys.chunk(WORLD, dim=1)[rank],
        os.path.join(tmp, f"rank{rank}.jsonl"),
    )


@pytest.mark.distributed
def test_ddp_stats_equal_one_process_on_the_combined_batch(tmp_path):
    launch(_worker, str(tmp_path))
    ref_path = tmp_path / "single.jsonl"
    xs, ys = make_data()
    train(make_model(), xs, ys, str(ref_path))
    ddp, ref = read_jsonl(tmp_path / "rank0.jsonl"), read_jsonl(ref_path)
    assert read_jsonl(tmp_path / "rank1.jsonl") == []  # written once, by rank 0
    assert_records_close(ddp, ref, STEPS)
