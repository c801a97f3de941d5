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


def _edit_warning_worker(rank: int, tmp: str) -> None:
    import warnings

    ddp = nn.parallel.DistributedDataParallel(make_model())
    attach = {
        "clip_max_norm": lambda: hs.clip_grads(ddp, max_norm=0.1),
        "clip_value": lambda: hs.clip_grads(ddp, value=0.01),
        "clamp": lambda: hs.edit_grads(ddp, {"module.0.weight": hs.ops.clamp(-0.1, 0.1)}),
        "callable": lambda: hs.edit_grads(ddp, {"module.0.bias": lambda g: g.sign()}),
        "zero": lambda: hs.edit_grads(ddp, {"module.0.bias": hs.ops.zero()}),
        "scale": lambda: hs.edit_grads(ddp, {"module.*.weight": hs.ops.scale(0.5)}),
        "replace": lambda: hs.edit_grads(ddp, {"module.4.bias": torch.tensor([0.25])}),
        "output": lambda: hs.edit_grads(ddp, {"module.1": hs.ops.clamp(-1, 1)}),
    }
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))
    said = {}
    for key, fn in attach.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with fn():
                ddp(x).sum().backward()
        ddp.zero_grad()
        said[key] = [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)]
    with open(os.path.join(tmp, f"said{rank}.txt"), "w") as f:
        for key, msgs in said.items():
            f.write(f"{key}\t{len(msgs)}\t{msgs[0] if msgs else ''}\n")


@pytest.mark.distributed
def test_ddp_non_linear_parameter_edits_warn_that_they_act_before_the_average(tmp_path):
    """PITFALL 18: under DDP a parameter's gradient hook sees the rank's own gradient. Clipping
    or clamping it is not clipping the averaged gradient (one process on the combined batch),
    and hookscope says so; edits that commute with the average, and edits of layer-output
    gradients (local to each rank's batch in one process too), do not warn."""
    launch(_edit_warning_worker, str(tmp_path))
    for rank in range(WORLD):
        rows = [r.split("\t") for r in (tmp_path / f"said{rank}.txt").read_text().splitlines()]
        said = {key: (int(n), msg) for key, n, msg in rows}
        warned = {key for key, (n, _) in said.items() if n}
        assert warned == {"clip_max_norm", "clip_value", "clamp", "callable"}
        assert all(said[k][0] == 1 for k in warned)
        assert "'module.0.weight', 'module.0.bias', 'module.2.weight' ..." in said["clip_value"][1]
        assert "'module.0.bias'" in said["callable"][1]
        for key in warned:
            assert "before DDP averages them" in said[key][1]
            assert "clip_grad_norm_" in said[key][1] and "fully_shard" in said[key][1]
