"""A metric that is NaN or infinite for every site (a log-probability of a token the model gives
probability 0, a NaN the model makes): the batched pass's check compared NaN with NaN as a
difference, so every layer fell back to one site per pass with a warning blaming the model for
mixing rows (values right, the warning false, the sweep slower). The same non-finite value batched
and alone is now no difference: no warning, the values those of a hand-written loop."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import hookscope as hs
from helpers.lm import tiny_gpt2

CLEAN = torch.tensor([[3, 7, 20, 8, 11, 12, 3, 13, 8, 15], [3, 9, 20, 10, 11, 12, 3, 14, 10, 15]])
CORRUPT = torch.tensor([[3, 7, 20, 8, 11, 12, 3, 13, 7, 15], [3, 9, 20, 10, 11, 12, 3, 14, 9, 15]])


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_a_non_finite_metric_is_swept_without_a_false_warning(bad):
    model = tiny_gpt2(n_layer=2).eval()

    def metric(out):
        lg = out.logits[:, -1]
        return (lg[:, 7] - lg[:, 8]).mean() * 0 + bad

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = hs.patch_sweep(model, CLEAN, CORRUPT, metric, hs.blocks(model))
    assert got.shape == (2, 10)
    if math.isnan(bad):
        assert bool(got.isnan().all())
    else:
        assert bool((got == bad).all())
