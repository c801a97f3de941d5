"""EigenCAM maps the first principal component of a layer's activations, for no class: a target
given to it was dropped without a word (the same map for target=3 and target=7). Now it warns
that the target is ignored; the map equals the one without a target."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def test_eigencam_says_a_target_is_ignored():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 5)
    )
    x = torch.randn(2, 3, 8, 8)
    cam = hs.EigenCAM(net, "1")
    plain = cam(x)
    for target in (3, [1, 4], torch.tensor([0, 2]), lambda out: out[:, 1]):
        with pytest.warns(hs.HookscopeWarning, match="EigenCAM: target=.* is ignored"):
            got = cam(x, target=target)
        assert torch.equal(got, plain)
