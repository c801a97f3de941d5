"""pool="avg"/"max" reduce a 3-D output over axis 1, the tokens of (batch, tokens, dim); on a
channels-first 1-D module's output (batch, channels, length) (Conv1d, BatchNorm1d, MaxPool1d...)
that averages the channels at each position, which a user reading "avg pools the spatial
dims" did not expect, and nothing said so. The rows are unchanged (documented, and part of a
run's fingerprint); a warning now names the layer and the pool for one value per channel."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs

DATA = [torch.randn(3, 20, generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(160, 2))


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_a_channels_first_layer_pooled_as_tokens_is_said(tmp_path, pool):
    net = _net()
    said = pytest.warns(hs.HookscopeWarning, match=r"layer '0' \(Conv1d\) gives \(batch, 8, 20\)")
    with said:
        feats = hs.extract(net, DATA, ["0"], tmp_path, pool=pool, batch_size=3, progress=False)
    with torch.no_grad():  # the rows as documented: axis 1 reduced, batch by batch
        out = torch.cat([net[0](torch.stack(DATA[i : i + 3])) for i in (0, 3)])
    want = out.mean(1) if pool == "avg" else out.amax(1)
    assert torch.equal(torch.from_numpy(feats["0"][:].copy()), want)


def test_token_outputs_and_other_pools_are_not_said(tmp_path):
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.extract(net, DATA, ["0"], tmp_path / "a", pool=None, batch_size=3, progress=False)
        hs.extract(net, DATA, ["3"], tmp_path / "b", pool="avg", batch_size=3, progress=False)
