"""Audit s19 of the Monitor under torch.distributed and parameter changes: histograms of the
combined batch, update ratios of parameters frozen, unfrozen, replaced or not stepped during a
step, and ranks whose steps are numbered differently. Each record is checked against a reference
computed by hand, or the monitor must say what it cannot record."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, launch

BINS = 16


# -- 1. histograms under torch.distributed: the combined batch's ---------------------------------
def _hist_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _hist_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, generator=g)
    x[7] *= 4.0  # the largest values on rank 1's half: rank 0's own range is narrower
    return x


def _by_hand(net: nn.Sequential, halves: list[torch.Tensor]) -> dict[str, list[float]]:
    """Each layer's output on each half (as each rank computes it), binned together over
    ``[-absmax, absmax]`` of both halves."""
    outs: dict[str, list[torch.Tensor]] = {"0": [], "1": [], "2": []}
    with torch.no_grad():
        for x in halves:
            h = x
            for name, m in net.named_children():
                h = m(h)
                outs[name].append(h.reshape(-1))
    ref = {}
    for name, parts in outs.items():
        v = torch.cat(parts)
        a = float(v.abs().max())
        ref[f"activations/{name}"] = (a, torch.histc(v / a, bins=BINS, min=-1, max=1).tolist())
    return ref


def _hist_worker(rank: int, out: str) -> None:
    net = _hist_net()
    halves = list(_hist_batch().chunk(WORLD))
    with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
        net(halves[rank]).sum().backward()
        rec = mon.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"got": rec.histograms, "ref": _by_hand(net, halves)}, f)


@pytest.mark.distributed
def test_histograms_under_distributed_are_the_combined_batchs(tmp_path):
    """Each rank binned over its own range and the record showed rank 0's counts only (half the
    batch, over rank 0's range): now every rank bins over the combined range (one all_reduce per
    layer call) and the counts are summed: those of one process on the whole batch."""
    out = str(tmp_path / "hist.json")
    launch(_hist_worker, out)
    with open(out) as f:
        saved = json.load(f)
    got, ref = saved["got"], saved["ref"]
    assert got.keys() == ref.keys() == {"activations/0", "activations/1", "activations/2"}
    for tag, (a, counts) in ref.items():
        edges, got_counts = got[tag]
        assert got_counts == counts, tag
        assert sum(got_counts) == 12 * (3 if tag.endswith("2") else 8)
        want = [a * (-1 + 2 * (j + 1) / BINS) for j in range(BINS)]
        assert edges == pytest.approx(want, rel=1e-6), tag
    # and one process running the whole batch records the same counts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = _hist_net()
        with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
            net(_hist_batch()).sum().backward()
            one = mon.step()
    finally:
        torch.set_num_threads(threads)
    for tag, (edges, counts) in one.histograms.items():
        assert got[tag][1] == counts, tag
        assert got[tag][0] == pytest.approx(edges, rel=1e-6), tag


def _tp_hist_worker(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    net = parallelize_module(_hist_net(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with hs.Monitor(net, stats=("activations",), histograms=BINS, alerts="off") as mon:
        net(_hist_batch()).sum().backward()  # tensor parallel: every rank runs the whole batch
        rec = mon.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"got": rec.histograms, "ref": _by_hand(_hist_net(), [_hist_batch()])}, f)


@pytest.mark.distributed
def test_histograms_under_tensor_parallel_are_the_full_outputs(tmp_path):
    """Tensor parallel: '0' and '1' output shards (their counts add up), '2' a replicated output
    (counted once): the histograms of one process running the model unsplit."""
    out = str(tmp_path / "hist.json")
    launch(_tp_hist_worker, out)
    with open(out) as f:
        saved = json.load(f)
    got, ref = saved["got"], saved["ref"]
    assert got.keys() == ref.keys()
    for tag, (a, counts) in ref.items():
        edges, got_counts = got[tag]
        assert got_counts == counts, tag
        assert edges == pytest.approx([a * (-1 + 2 * (j + 1) / BINS) for j in range(BINS)]), tag
