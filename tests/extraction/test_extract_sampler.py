"""extract honours a DataLoader's sampler (rows land at their dataset index), a
DistributedSampler (the union of its replicas), and resumes with another world size."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_extract import Interrupting, TokenNet, reference
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hookscope as hs
from helpers.common import one_thread
from helpers.dist import WORLD, launch


def make() -> tuple[TokenNet, TensorDataset]:
    torch.manual_seed(0)
    net = TokenNet()
    g = torch.Generator().manual_seed(1)
    return net, TensorDataset(torch.randn(11, 3, 6, 6, generator=g), torch.arange(11))


def test_subset_sampler_rows_land_at_their_dataset_index(tmp_path):
    net, data = make()
    chosen = [7, 2, 5, 9]
    loader = DataLoader(data, batch_size=3, sampler=SubsetRandomSampler(chosen))
    feats = hs.extract(net, loader, ["head", "conv"], tmp_path, progress=False)
    ref = reference(net, data.tensors[0])
    assert feats.count == 11 and sorted(np.flatnonzero(feats.valid)) == sorted(chosen)
    for layer in ("head", "conv"):
        np.testing.assert_allclose(
            feats[layer][chosen], ref[layer][chosen].numpy(), rtol=1e-5, atol=1e-6
        )
        others = [i for i in range(11) if i not in chosen]
        assert np.isnan(feats[layer][others]).all()
    assert feats.manifest["not_extracted"] == [0, 1, 3, 4, 6, 8, 10]
    assert feats.manifest["valid"] == 4


def _worker(rank: int, tmp: str) -> None:
    net, data = make()
    # resume, on 2 processes, the run one process started
    hs.extract(net, data, "conv", os.path.join(tmp, "resumed"), batch_size=2, progress=False)
    # a DistributedSampler (shuffled, drop_last: one sample is in no replica)
    sampler = DistributedSampler(data, WORLD, rank, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    hs.extract(net, loader, "head", os.path.join(tmp, "sampled"), progress=False)


@pytest.mark.distributed
def test_distributed_sampler_and_resume_with_another_world_size(tmp_path):
    """The promise: every row is computed in the batch an uninterrupted run puts it in, so a run
    resumed with another number of processes equals it within float rounding, and byte for byte
    when every process runs the same kernels (here: one CPU thread, like the ranks)."""
    net, data = make()
    with one_thread(), pytest.raises(KeyboardInterrupt):  # batches 0-1 (rows 0-3) on disk
        hs.extract(
            net, Interrupting(data, 5), "conv", tmp_path / "resumed", batch_size=2, progress=False
        )
    launch(_worker, str(tmp_path))
    ref = reference(net, data.tensors[0])
    resumed = hs.load_features(tmp_path / "resumed")
    assert resumed.valid.all() and resumed.count == 11
    np.testing.assert_allclose(resumed["conv"], ref["conv"].numpy(), rtol=1e-5, atol=1e-6)
    with one_thread():
        hs.extract(net, data, "conv", tmp_path / "one", batch_size=2, progress=False)
    assert (tmp_path / "resumed" / "conv.npy").read_bytes() == (
        tmp_path / "one" / "conv.npy"
    ).read_bytes()
    # at this process's own thread count the kernels may round differently: rounding-level equal
    threads = hs.extract(net, data, "conv", tmp_path / "threads", batch_size=2, progress=False)
    np.testing.assert_allclose(resumed["conv"], threads["conv"], rtol=1e-6, atol=1e-6)
    sampled = hs.load_features(tmp_path / "sampled")
    union = set()
    for r in range(WORLD):
        union |= set(DistributedSampler(data, WORLD, r, shuffle=True, seed=3, drop_last=True))
    assert len(union) == 10  # 11 samples, 5 per replica
    rows = sorted(union)
    assert list(np.flatnonzero(sampled.valid)) == rows
    np.testing.assert_allclose(
        sampled["head"][rows], ref["head"][rows].numpy(), rtol=1e-5, atol=1e-6
    )
    assert np.isnan(sampled["head"][~sampled.valid]).all()
