"""Fallbacks in core (audit s20): each path taken after another failed is exact or said."""

from __future__ import annotations

import types
from collections.abc import Mapping, MutableMapping

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.core._errors import HookscopeWarning


class Bag(MutableMapping):
    """A mapping keeping its items in a dict of its own: its shallow copy shares that dict."""

    def __init__(self, **kw):
        self._d = dict(kw)

    def __getitem__(self, k):
        return self._d[k]

    def __setitem__(self, k, v):
        self._d[k] = v

    def __delitem__(self, k):
        del self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Frozen(Mapping):
    """A read-only mapping whose class takes keywords only."""

    def __init__(self, **kw):
        self._d = dict(kw)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class _Layer(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


class _Net(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.a = _Layer(make)

    def forward(self, x):
        o = self.a(x)
        return o["h"].pow(2).sum(), type(o)


def test_capture_of_a_mapping_sharing_its_storage_leaves_the_live_output_alone():
    """The shallow copy of a ``Bag`` shares its dict: capture's clones were written into the
    model's own output, whose loss then lost its graph (requires_grad False, no gradient)."""
    torch.manual_seed(0)
    net, x = _Net(lambda h: Bag(h=h)), torch.randn(2, 3)
    ref_y = net(x)[0]
    (ref_g,) = torch.autograd.grad(ref_y, net.a.lin.weight)
    with hs.capture(net, "a") as cap:
        y, kind = net(x)
    assert kind is Bag and y.requires_grad
    (g,) = torch.autograd.grad(y, net.a.lin.weight)
    torch.testing.assert_close(g, ref_g, rtol=0, atol=0)
    kept = cap["a"]
    assert type(kept) is Bag
    torch.testing.assert_close(kept["h"], net.a.lin(x).detach(), rtol=0, atol=0)


def test_edit_keeps_a_read_only_mapping_type_it_can_rebuild():
    """A layer returning a ``MappingProxyType``: an edit handed the model a plain dict."""
    torch.manual_seed(0)
    net, x = _Net(lambda h: types.MappingProxyType({"h": h})), torch.randn(2, 3)
    with hs.edit(net, {"a": hs.ops.scale(2.0)}):
        y, kind = net(x)
    assert kind is types.MappingProxyType
    ref = (2 * net.a.lin(x)).pow(2).sum()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_a_mapping_that_cannot_be_rebuilt_is_said():
    """A read-only mapping whose class takes keywords: a plain dict stands for it, said."""
    torch.manual_seed(0)
    net, x = _Net(lambda h: Frozen(h=h)), torch.randn(2, 3)
    warned = pytest.warns(HookscopeWarning, match="a Frozen among a layer's values")
    with warned, hs.edit(net, {"a": hs.ops.scale(2.0)}):
        y, kind = net(x)
    assert kind is dict
    torch.testing.assert_close(y, (2 * net.a.lin(x)).pow(2).sum(), rtol=0, atol=0)
