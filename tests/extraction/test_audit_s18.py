"""Audit (s18) of extract / load_features for silently wrong or lost features: layers of different
dtypes in one run, float16 overflow, files damaged on disk, and changes between a run and its
resume that the fingerprint did not see. Every value is checked against a plain forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import hookscope as hs


class _Interrupting(Dataset):
    """Raises KeyboardInterrupt at index ``at`` (Ctrl-C mid-run)."""

    def __init__(self, base: Dataset, at: int) -> None:
        self.base, self.at = base, at

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i == self.at:
            raise KeyboardInterrupt
        return self.base[i]


class _ThreeKinds(nn.Module):
    """A real layer, a complex one (an FFT) and an int64 one with values float64 cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.spec, self.code = nn.Linear(4, 4), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.spec(torch.fft.fft(y))
        self.code((y * 1e3).long() + 2**60 + 1)
        return y


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_layers_of_different_dtypes_keep_each_its_own(tmp_path, dtype):
    """Layers of different dtypes in one run were all stored as float64 (np.dtype(None)): the
    complex layer lost its imaginary part (a numpy warning from the writer thread), the int64
    one was rounded, while the manifest claimed complex64 and int64. Each file now holds its
    layer's dtype and the exact values of a plain forward."""
    torch.manual_seed(0)
    model = _ThreeKinds()
    x = torch.randn(6, 4)
    with torch.no_grad():
        y = model.lin(x)
        want = {"lin": y, "spec": torch.fft.fft(y), "code": (y * 1e3).long() + 2**60 + 1}
    feats = hs.extract(
        model, TensorDataset(x), ["lin", "spec", "code"], tmp_path, batch_size=4, dtype=dtype,
        progress=False,
    )  # fmt: skip
    # dtype=float32 casts the int64 layer as asked; the complex one stays complex (complex64)
    kinds = {
        "lin": np.float32,
        "spec": np.complex64,
        "code": np.int64 if dtype is None else np.float32,
    }
    for layer, kind in kinds.items():
        got = np.load(tmp_path / feats.manifest["files"][layer])
        assert got.dtype == kind, layer
        assert feats.manifest["dtypes"][layer] == np.dtype(kind).name
        np.testing.assert_array_equal(got, want[layer].numpy().astype(kind), err_msg=layer)
