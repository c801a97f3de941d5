"""Selection audit (s20): one module registered under several names, and names behind a wrapper.

``nn.Module.named_modules`` lists a module registered twice once, under its first name, so a
second name selected nothing (or, in ``blocks``, a list of one shared block read as one block)
without saying why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a  # one module, two names
        self.c = nn.Linear(3, 3)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class SharedStack(nn.Module):
    """ALBERT-style weight sharing written as a list holding one block three times."""

    def __init__(self):
        super().__init__()
        blk = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.layers = nn.ModuleList([blk, blk, blk])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_second_name_of_a_module_names_its_first_name():
    with pytest.raises(hs.LayerNotFoundError, match=r"'b' is the module named 'a'"):
        hs.find(Tied(), "b")


def test_both_calls_of_a_module_under_two_names_are_recorded_under_its_first_name():
    m = Tied()
    x = torch.randn(2, 3)
    with hs.capture(m, "a") as cap:
        m(x)
    calls = cap.calls("a")
    assert len(calls) == 2
    first = m.a(x)
    torch.testing.assert_close(calls[0].output, first, rtol=0, atol=0)
    torch.testing.assert_close(calls[1].output, m.a(first), rtol=0, atol=0)


def test_a_glob_matching_second_names_says_they_are_selected_under_the_first():
    m = SharedStack()
    with pytest.warns(hs.HookscopeWarning, match=r"'layers\.1', 'layers\.2'.*'layers\.0'"):
        got = hs.find(m, "layers.?")
    assert list(got) == ["layers.0"]


def test_a_glob_matching_no_second_name_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(hs.find(SharedStack(), "head*")) == ["head"]
        assert list(hs.find(Tied(), "a")) == ["a"]


def test_blocks_of_a_list_holding_one_block_three_times_say_so():
    m = SharedStack()
    with pytest.warns(hs.HookscopeWarning, match=r"one module.*3 names"):
        got = hs.blocks(m)
    assert list(got) == ["layers.0"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fc", "module.fc"), ("avgpool", "module.avgpool"), ("layer1", "module.layer1")],
)
def test_a_name_behind_a_wrapper_prefix_is_suggested(name, expected):
    net = nn.Sequential()
    net.add_module("layer1", nn.Linear(2, 2))
    net.add_module("avgpool", nn.Identity())
    net.add_module("fc", nn.Linear(2, 2))
    dp = nn.DataParallel(net)
    with pytest.raises(hs.LayerNotFoundError) as err:
        hs.find(dp, name)
    assert f"closest valid names: {expected!r}" in str(err.value)


def test_a_child_behind_a_checkpoint_wrapper_is_suggested():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    m = nn.Module()
    m.layers = nn.ModuleList(
        [checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) for _ in range(2)]
    )
    with pytest.raises(hs.LayerNotFoundError, match=r"'_checkpoint_wrapped_module\.0'"):
        hs.blocks(m, "0")
    with pytest.raises(
        hs.LayerNotFoundError,
        match=r"closest valid names: 'layers\.0\._checkpoint_wrapped_module\.0'",
    ):
        hs.find(m, "layers.0.0")
