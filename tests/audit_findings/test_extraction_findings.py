"""Audit findings for hs.extract (owner: extraction). Each test fails on main for the reason given."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import hookscope as hs

pytestmark = pytest.mark.skip(reason="audit finding, not yet fixed")


class _FunctionalDropout(nn.Module):
    """Dropout called as a function with training=True: eval() does not turn it off."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.5))


def test_extract_does_not_silently_store_features_of_a_stochastic_forward(tmp_path):
    """User extracts layer 'b' of a model whose forward draws random numbers (functional dropout,
    which extract's eval() does not turn off): two runs into two folders give different features
    (a resume would mix draws), with no warning; extract should refuse or warn (as patch_sweep,
    steering_vector and compare do, with core._random.random_draws)."""
    torch.manual_seed(0)
    net = _FunctionalDropout().eval()
    data = TensorDataset(torch.randn(10, 8))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            f1 = hs.extract(net, data, ["b"], tmp_path / "one", progress=False)
            f2 = hs.extract(net, data, ["b"], tmp_path / "two", progress=False)
        except hs.HookscopeError:
            return
    if any(issubclass(c.category, hs.HookscopeWarning) for c in w):
        return
    torch.testing.assert_close(torch.tensor(f1["b"][:]), torch.tensor(f2["b"][:]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_extract_refuses_a_storage_dtype_that_cannot_hold_features(tmp_path, dtype):
    """User passes dtype=torch.int64 (or uint8, bool) to extract: float features such as
    [-0.48, -0.10, -0.60, -0.18] are stored as [0, 0, 0, 0] (bool: all True), silently; a
    non-floating dtype should raise naming dtype= and the valid choices (float16/bfloat16/float32)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    data = TensorDataset(torch.randn(10, 8))
    with pytest.raises((TypeError, ValueError, hs.HookscopeError), match="dtype"):
        hs.extract(net, data, ["0"], tmp_path / "out", progress=False, dtype=dtype)
