"""summary's "Activations" total added the outputs of the innermost layers, so an in-place
activation's output (the same memory as the layer before it: BatchNorm -> ReLU(inplace=True))
and a view (nn.Flatten) were counted again: 2.5x the bytes the forward made on this net. An
output that shares memory with its call's input is not counted again now; the rows' own
output bytes are unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn

import hookscope as hs


def test_in_place_results_and_views_are_not_counted_twice():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 5),
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    s = hs.summary(net, x)
    # by hand: the tensors the layers made (conv, batch norm, linear); ReLU wrote into the
    # batch norm's output, Flatten viewed it
    conv = 2 * 4 * 8 * 8 * 4
    assert s.totals.activation_bytes == conv + conv + 2 * 5 * 4
    rows = {r.name: r.output_bytes for r in s.rows}
    assert rows["2"] == rows["3"] == conv  # each row still says what its output holds
