"""Monitor under DistributedDataParallel (gloo, 2 CPU processes on loopback): statistics reduced
across ranks, written once by rank 0, equal to a one-process run on the combined batch."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookscope as hs

WORLD = 2
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


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ddp = nn.parallel.DistributedDataParallel(make_model())
        xs, ys = make_data()
        train(
            ddp,
            xs.chunk(WORLD, dim=1)[rank],
            ys.chunk(WORLD, dim=1)[rank],
            os.path.join(tmp, f"rank{rank}.jsonl"),
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.distributed
def test_ddp_stats_equal_one_process_on_the_combined_batch(tmp_path):
    # fork: the children need not import torch again (several seconds each on a busy machine);
    # they use one thread, so the parent's thread pool is never needed after the fork
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method=method
    )
    ref_path = tmp_path / "single.jsonl"
    xs, ys = make_data()
    train(make_model(), xs, ys, str(ref_path))
    ddp, ref = read(tmp_path / "rank0.jsonl"), read(ref_path)
    assert read(tmp_path / "rank1.jsonl") == []  # written once, by rank 0
    assert [r["step"] for r in ddp] == [r["step"] for r in ref] == list(range(STEPS))
    for d, r in zip(ddp, ref):
        assert d["layers"].keys() == r["layers"].keys() and d["params"].keys() == r["params"].keys()
        for group in ("layers", "params"):
            for name, stats in r[group].items():
                assert stats.keys() == d[group][name].keys(), (group, name)
                for k, v in stats.items():
                    assert math.isclose(d[group][name][k], v, rel_tol=1e-4, abs_tol=1e-7), (
                        group,
                        name,
                        k,
                        d[group][name][k],
                        v,
                    )
