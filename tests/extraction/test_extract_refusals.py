"""extract refuses, naming the argument or the cause, what would store wrong or unrepeatable
features: a storage dtype that cannot hold them, a forward that draws random numbers, and a folder
holding another run (naming the setting that changed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import hookscope as hs


class _FunctionalDropout(nn.Module):
    """Dropout called as a function with training=True: eval() does not turn it off."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.5))


def test_extract_refuses_a_forward_that_draws_random_numbers(tmp_path):
    """A model whose forward calls F.dropout(x, 0.5) (not turned off by eval()): two runs would
    store different features; extract raises at its first forward, naming the functional dropout
    and the fix, and writes no manifest."""
    torch.manual_seed(0)
    net = _FunctionalDropout().eval()
    data = TensorDataset(torch.randn(10, 8))
    with pytest.raises(hs.ExtractError, match=r"draws random numbers.*training=self\.training"):
        hs.extract(net, data, ["b"], tmp_path / "one", progress=False)
    assert not (tmp_path / "one" / "manifest.json").exists()


def test_extract_of_a_deterministic_forward_with_dropout_modules_is_accepted(tmp_path):
    """nn.Dropout modules are off in eval mode (extract's): the features equal a plain eval
    forward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(10, 8)
    feats = hs.extract(net, TensorDataset(x), ["2"], tmp_path / "out", progress=False)
    with torch.no_grad():
        ref = net.eval()(x)
    torch.testing.assert_close(torch.tensor(feats["2"][:]), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_extract_refuses_a_storage_dtype_that_cannot_hold_features(tmp_path, dtype):
    """dtype=torch.int64 (or uint8, bool) would store float features such as
    [-0.48, -0.10, -0.60, -0.18] as [0, 0, 0, 0] (bool: all True): it raises a TypeError naming
    dtype= and the valid choices, before any file is written."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    data = TensorDataset(torch.randn(10, 8))
    with pytest.raises(TypeError, match=r"dtype= must be a floating dtype.*torch\.float16"):
        hs.extract(net, data, ["0"], tmp_path / "out", progress=False, dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_run_is_refused_naming_what_changed(tmp_path):
    """A finished run at batch_size=4 in float32, then the same call with batch_size=5 and
    dtype=float16: the refusal names dtype and batch size with both values; a change of weights
    alone is named as the model weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    data = TensorDataset(torch.randn(10, 8))
    hs.extract(net, data, ["0"], tmp_path / "out", batch_size=4, progress=False)
    with pytest.raises(
        hs.ExtractError,
        match=r"its dtype \(None there, torch\.float16 here\) and batch size \(4 there, 5 here\) "
        r"differ",
    ):
        hs.extract(
            net, data, ["0"], tmp_path / "out", batch_size=5, dtype=torch.float16, progress=False
        )
    with torch.no_grad():
        net[0].weight.add_(1.0)
    with pytest.raises(hs.ExtractError, match=r"its model weights differ"):
        hs.extract(net, data, ["0"], tmp_path / "out", batch_size=4, progress=False)


class _Spectrum(nn.Module):
    """A layer giving complex values (an FFT of a linear layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.fft(self.lin(x), dim=-1)


class _SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.o = _Spectrum(), nn.Linear(8, 2)

    def forward(self, x):
        return self.o(self.f(x).real)


def test_complex_features_keep_their_imaginary_part_or_are_refused_by_name(tmp_path):
    """dtype=torch.float32 on a complex layer saved its real part only (silently), float16 with a
    PyTorch warning: float32 now saves complex64, float16 (no complex float16 in numpy) is refused
    naming the layer and the choices, and writes no feature file."""
    torch.manual_seed(0)
    model = _SpectralNet()
    data = [torch.randn(8) for _ in range(6)]
    with torch.no_grad():
        want = model.f(torch.stack(data)).numpy()
    for dtype in (None, torch.float32):
        feats = hs.extract(model, data, ["f"], tmp_path / str(dtype), dtype=dtype, batch_size=4,
                           progress=False)  # fmt: skip
        got = np.asarray(feats["f"])
        assert got.dtype == np.complex64
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(hs.ExtractError, match=r"layer 'f' gives complex64 .*dtype=torch\.float32"):
        hs.extract(model, data, ["f"], tmp_path / "half", dtype=torch.float16, progress=False)
    assert not any(p.is_file() for p in (tmp_path / "half").rglob("*"))
