"""Monitor under DistributedDataParallel (gloo, 2 CPU processes on loopback): statistics reduced
across ranks, written once by rank 0, equal to a one-process run on the combined batch."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, assert_records_close, launch, read_jsonl

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


# -- gradient edits and clipping act on the averaged gradient ---------------------------------------
MAX_NORM, VALUE = 0.03, 0.02

EDITS = {
    "clip_max_norm": lambda m, p: [hs.clip_grads(m, max_norm=MAX_NORM)],
    "clip_value": lambda m, p: [hs.clip_grads(m, value=VALUE)],
    "edit": lambda m, p: [
        hs.edit_grads(
            m,
            {
                p + "0.weight": hs.ops.clamp(-VALUE, VALUE),
                p + "0.bias": lambda g: g.sign() * 0.1,  # the sign of the average, not of a rank's
                p + "2.weight": hs.ops.scale(3.0),
                p + "4.bias": torch.tensor([0.25]),
                p + "3": hs.ops.scale(0.5),  # a layer-output gradient
            },
        )
    ],
    # two scopes on one model chain like two tensor hooks: clamp, then scale
    "two_scopes": lambda m, p: [
        hs.clip_grads(m, value=VALUE),
        hs.edit_grads(m, {p + "2.weight": hs.ops.scale(3.0)}),
    ],
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}


def _ddp_edit_worker(rank: int, tmp: str) -> None:
    from contextlib import ExitStack

    xs, ys = make_data()
    mine = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in zip(xs, ys)]
    loss = nn.functional.mse_loss
    out = {}
    for key, attach in EDITS.items():
        ddp = nn.parallel.DistributedDataParallel(make_model())
        with ExitStack() as stack:
            for scope in attach(ddp, "module."):
                stack.enter_context(scope)
            loss(ddp(mine[0][0]), mine[0][1]).backward()
        out[key] = _grads(ddp)
    # accumulation, every backward synchronized: each one's averaged gradient clamped on its own
    ddp = nn.parallel.DistributedDataParallel(make_model())
    with hs.clip_grads(ddp, value=VALUE):
        for x, y in mine:
            loss(ddp(x), y).backward()
    out["accumulate"] = _grads(ddp)
    # accumulation under no_sync(): DDP averages the sum once; clipped once, the step's gradient
    ddp = nn.parallel.DistributedDataParallel(make_model())
    with hs.clip_grads(ddp, max_norm=MAX_NORM):
        with ddp.no_sync():
            loss(ddp(mine[0][0]), mine[0][1]).backward()
        loss(ddp(mine[1][0]), mine[1][1]).backward()
    out["no_sync"] = _grads(ddp)
    # the user's own communication hook (DDP allows one): hookscope needs none, edits its result
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(make_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with hs.clip_grads(ddp, max_norm=MAX_NORM):
        loss(ddp(mine[0][0]), mine[0][1]).backward()
    out["comm_hook"] = _grads(ddp)
    # the scope given ddp.module (the model inside the wrapper): DDP still averages its
    # parameters' gradients, so the edit acts on the average, as given the wrapper
    ddp = nn.parallel.DistributedDataParallel(make_model())
    with hs.clip_grads(ddp.module, max_norm=MAX_NORM):
        loss(ddp(mine[0][0]), mine[0][1]).backward()
    out["inner_module"] = _grads(ddp)
    # .grad as views into DDP's buckets: the same as "accumulate"
    ddp = nn.parallel.DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    with hs.clip_grads(ddp, value=VALUE):
        for x, y in mine:
            loss(ddp(x), y).backward()
    out["bucket_view"] = _grads(ddp)
    # a backward whose forward ran before the scope opened: its average cannot be edited -> raises
    ddp = nn.parallel.DistributedDataParallel(make_model())
    early = loss(ddp(mine[0][0]), mine[0][1])
    with hs.clip_grads(ddp, value=VALUE), pytest.raises(hs.HookscopeError) as refused:
        early.backward()
    out["refused"] = str(refused.value)
    if rank == 0:
        torch.save(out, os.path.join(tmp, "grads.pt"))


def _reference_grads() -> dict[str, dict[str, torch.Tensor]]:
    """One process, the combined batch, torch.autograd.grad, edited by hand."""
    xs, ys = make_data()
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    g0, g1 = (
        dict(zip(names, torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)))
        for x, y in zip(xs, ys)
    )

    def clip(t: torch.Tensor) -> torch.Tensor:
        return t * min(1.0, MAX_NORM / (float(t.norm()) + 1e-6))

    # the layer-output edit halves the gradient flowing back through layer 3 (the ReLU): the
    # gradients of the layers before it halve (a layer-output gradient is each rank's own, scaled
    # by its loss's 1/batch; only a linear edit of it equals one process's)
    edited_out = {n: (t if n.startswith("4.") else 0.5 * t) for n, t in g0.items()}
    edit = dict(edited_out)
    edit["0.weight"] = edited_out["0.weight"].clamp(-VALUE, VALUE)
    edit["0.bias"] = edited_out["0.bias"].sign() * 0.1
    edit["2.weight"] = 3 * edited_out["2.weight"]
    edit["4.bias"] = torch.tensor([0.25])
    clamp = {n: t.clamp(-VALUE, VALUE) for n, t in g0.items()}
    two = dict(clamp)
    two["2.weight"] = 3 * clamp["2.weight"]
    return {
        "raw": g0,
        "clip_max_norm": {n: clip(t) for n, t in g0.items()},
        "clip_value": clamp,
        "edit": edit,
        "two_scopes": two,
        "accumulate": {
            n: t.clamp(-VALUE, VALUE) + g1[n].clamp(-VALUE, VALUE) for n, t in g0.items()
        },
        "no_sync": {n: clip(t + g1[n]) for n, t in g0.items()},
        "comm_hook": {n: clip(t) for n, t in g0.items()},
        "inner_module": {n: clip(t) for n, t in g0.items()},
        "bucket_view": {
            n: t.clamp(-VALUE, VALUE) + g1[n].clamp(-VALUE, VALUE) for n, t in g0.items()
        },
    }


@pytest.mark.distributed
def test_ddp_gradient_edits_act_on_the_averaged_gradient(tmp_path):
    """docs/pitfalls.md §18: a parameter's tensor hook sees the rank's own gradient; hookscope edits the
    average DDP writes into .grad instead, so clip_grads / edit_grads under DDP equal one process
    on the combined batch, with and without accumulation (no_sync: once, on the step's sum)."""
    launch(_ddp_edit_worker, str(tmp_path))
    got, ref = torch.load(tmp_path / "grads.pt"), _reference_grads()
    raw = ref.pop("raw")  # the edits bind: every norm is above MAX_NORM, values exceed VALUE
    assert min(float(t.norm()) for t in raw.values()) > 2 * MAX_NORM
    assert all(float(t.abs().max()) > VALUE for t in raw.values())
    refused = got.pop("refused")
    assert (
        "clip_grads: parameter 'module." in refused
        and "Open the scope before the forward" in refused
    )
    assert got.keys() == ref.keys()
    for key, want in ref.items():
        assert got[key].keys() == want.keys(), key
        for name, t in want.items():
            torch.testing.assert_close(got[key][name], t, rtol=1e-5, atol=1e-7, msg=f"{key} {name}")
    for key in ("clip_max_norm", "no_sync"):
        norms = [float(t.norm()) for t in got[key].values()]
        assert all(math.isclose(v, MAX_NORM, rel_tol=1e-4) for v in norms), (key, norms)
