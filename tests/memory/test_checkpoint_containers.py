"""A checkpointed forward that changes Python containers (lists, dicts, sets, deques, nested ones,
held by any module of the checkpointed subtree) changes them once per step, as without
checkpointing: the recompute leaves no trace in them, and it sees their contents at the call."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import hookscope as hs


class _KeepsMaps(nn.Module):
    """Stores each call's activation in a list (as models that keep attention maps to plot do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.maps: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.maps.append(y.detach())
        return y.relu()


@pytest.mark.parametrize("nested", [False, True])
def test_checkpointed_forward_that_appends_to_a_list_appends_once_per_step(nested):
    """A module whose forward appends its activation to self.maps, checkpointed itself or inside
    a checkpointed block: after one step the list holds the one activation of the forward."""
    torch.manual_seed(0)
    inner = _KeepsMaps()
    net = nn.Sequential(nn.Sequential(inner, nn.Linear(8, 8)) if nested else inner, nn.Linear(8, 1))
    x = torch.randn(4, 8)
    handle = hs.apply_checkpointing(net, ["0"])
    try:
        net(x).sum().backward()
    finally:
        handle.remove()
    assert len(inner.maps) == 1
    torch.testing.assert_close(inner.maps[0], inner.lin(x).detach(), rtol=0, atol=0)


class _Bookkeeper(nn.Module):
    """Changes a dict, a set, a bounded deque and a list nested in a dict at every call, and
    reads the dict's size in its output (a recompute must see the contents at the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[int, int] = {}
        self.tags: set[str] = set()
        self.last = collections.deque(maxlen=2)
        self.log: dict[str, list[int]] = {"calls": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.seen)
        self.seen[n] = n
        self.tags.add(f"call{n}")
        self.last.append(n)
        self.log["calls"].append(n)
        return self.lin(x) * (n + 1)


def test_recompute_leaves_dicts_sets_deques_and_nested_lists_as_one_forward_left_them():
    """Three steps of a checkpointed module that counts its calls in a dict: the containers
    hold what three plain forwards leave, and the gradients (which scale with the dict's size at
    the call) match those of the same steps without checkpointing."""
    torch.manual_seed(0)
    ref, ckpt = _Bookkeeper(), _Bookkeeper()
    ckpt.load_state_dict(ref.state_dict())
    xs = [torch.randn(3, 4) for _ in range(3)]
    for x in xs:
        ref(x).sum().backward()
    handle = hs.apply_checkpointing(nn.Sequential(ckpt), ["0"])
    try:
        for x in xs:
            ckpt(x).sum().backward()
    finally:
        handle.remove()
    assert ckpt.seen == {0: 0, 1: 1, 2: 2} == ref.seen
    assert ckpt.tags == {"call0", "call1", "call2"}
    assert list(ckpt.last) == [1, 2]
    assert ckpt.log == {"calls": [0, 1, 2]}
    torch.testing.assert_close(ckpt.lin.weight.grad, ref.lin.weight.grad, rtol=0, atol=0)


def test_memory_profile_leaves_a_list_the_forward_appends_to_as_found():
    """memory_profile runs one step and leaves the model as found: a list the forward appends
    to holds what it held before."""
    inner = _KeepsMaps()
    inner.maps.append(torch.zeros(1))
    first = inner.maps[0]
    hs.memory_profile(nn.Sequential(inner, nn.Linear(8, 1)), torch.randn(2, 8))
    assert len(inner.maps) == 1 and inner.maps[0] is first


class _TensorCounter(nn.Module):
    """Counts its calls in a tensor attribute (not a buffer) changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_recompute_that_changes_a_tensor_attribute_in_place_warns_naming_it():
    """A checkpointed module adding 1 in place to a tensor attribute: the recompute adds again
    (no copy was kept to undo it): a HookscopeWarning names the attribute and the fix
    (register_buffer), and the count shows the two additions."""
    inner = _TensorCounter()
    handle = hs.apply_checkpointing(nn.Sequential(inner), ["0"])
    try:
        with pytest.warns(hs.HookscopeWarning, match=r"attribute '0\.calls'.*register_buffer"):
            inner(torch.randn(2, 4)).sum().backward()
    finally:
        handle.remove()
    assert float(inner.calls) == 2.0


def test_memory_profile_puts_back_a_tensor_attribute_changed_in_place():
    """memory_profile's step adds 1 to a tensor attribute in place: it holds its value before."""
    inner = _TensorCounter()
    inner.calls.fill_(5.0)
    hs.memory_profile(inner, torch.randn(2, 4))
    assert float(inner.calls) == 5.0
