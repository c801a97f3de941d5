"""Fallbacks in extraction (audit s20): each path taken after another failed is exact or said."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs


class _QuantTable(nn.Module):
    """A linear layer scaled by a table kept quantized (a buffer whose bytes cannot be viewed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        table = torch.quantize_per_tensor(torch.rand(4000), 0.01, 0, torch.qint8)
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.table.dequantize()[2000]


def _loader(x: torch.Tensor) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_a_quantized_buffer_with_another_scale_is_another_model(tmp_path):
    """The weights' fingerprint hashed a quantized tensor's integers only: the same integers at
    twice the scale (every value the forward reads doubled) left it as it was, and the resume
    returned the first model's features (reference: the model's own output, 2x the stored)."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    m = _QuantTable().eval()
    hs.extract(m, _loader(x), ["fc"], tmp_path / "a", progress=False)
    m.table = torch._make_per_tensor_quantized_tensor(m.table.int_repr(), 0.02, 0)
    with pytest.raises(hs.ExtractError, match="model weights differ"):
        hs.extract(m, _loader(x), ["fc"], tmp_path / "a", progress=False)
