"""core/_buffers.py: a model's buffers put back as found after a forward that must leave no
trace, against a copy of its state taken by hand before the forward."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.core._buffers import buffers_kept, state_kept


class _Changes(nn.Module):
    """Every way a forward changes buffers: BatchNorm's statistics in place, a count reassigned,
    a cache re-registered at another length, a buffer resized in place, a buffer added."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.register_buffer("grow", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        self.register_buffer("cache", torch.arange(float(x.shape[0])), persistent=False)
        self.grow.resize_(5).fill_(7.0)
        self.register_buffer("added", torch.ones(1))
        return self.bn(x) + self.cache[:, None]


def test_every_buffer_is_the_same_object_with_the_same_values_and_no_buffer_is_added():
    torch.manual_seed(0)
    m = _Changes().train()
    objects = {n: b for n, b in m.named_buffers()}
    values = {n: b.clone() for n, b in m.named_buffers()}
    with buffers_kept(m):
        m(torch.randn(3, 4))
        assert m.steps.item() == 1.0 and m.grow.shape == (5,)  # the forward did change them
    assert dict(m.named_buffers()).keys() == objects.keys()
    for n, b in m.named_buffers():
        assert b is objects[n], n
        assert b.shape == values[n].shape and torch.equal(b, values[n]), n
    assert "added" not in m._buffers and not hasattr(m, "added")


def test_plain_attributes_are_put_back_and_a_private_mark_added_is_kept():
    """A counter added by the forward is removed, a tensor attribute changed in place gets its
    values back, a list its contents; a private attribute the forward added (a class's mark of
    state not undone, e.g. hooks it installed) stays."""
    from helpers.common import Counting
    from hookscope.core._buffers import state_kept

    m = Counting(3)
    total, seen = m.total, m.seen
    with state_kept(m):
        m(torch.ones(1, 3))
        m._installed = True
        assert m.state() == (True, 1, [float(torch.ones(3).norm())], 1.0)  # the forward did
    assert m.state() == (False, 0, [], 0.0)
    assert m.total is total and m.seen is seen  # the same objects, their values put back
    assert m._installed is True


def test_a_class_pytorch_made_from_the_model_s_own_is_kept_too():
    """weight_norm turns a user's Block into torch.nn.utils.parametrize's ParametrizedBlock
    (FSDP2 into FSDPBlock): its counter was left changed (compare then named an exact copy's
    layer). Classes with the user's class in their MRO are the model's own."""
    from hookscope.core._buffers import state_kept

    class Block(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x) * self.calls

    m = nn.utils.parametrizations.weight_norm(Block(3, 3))
    assert type(m).__module__.startswith("torch.")
    with state_kept(m):
        m(torch.ones(1, 3))
    assert "calls" not in m.__dict__


def test_a_module_its_forward_built_is_left_built_whole():
    """A forward that registers a parameter (``self.weight = nn.Parameter(...)`` over a None
    attribute) or materializes a lazy one built the module: putting back its plain attributes
    (weight None, in_features 0) left it half built (a new random weight on the next call, an
    optimizer holding a stale one). Such a module is left as built."""
    from hookscope.core._buffers import state_kept

    class LazyProj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.weight is None:
                self.weight = nn.Parameter(torch.randn(4, x.shape[-1]))
            return x @ self.weight.t()

    class MyLazy(nn.LazyLinear):
        pass

    m = nn.Sequential(LazyProj(), MyLazy(2))
    with state_kept(m):
        m(torch.randn(3, 5))
    assert isinstance(m[0].weight, nn.Parameter) and m[0].weight is m[0]._parameters["weight"]
    assert m[1].in_features == 4 and m[1].weight.shape == (2, 4)
    assert hs.summary(nn.Sequential(MyLazy(2)), torch.randn(3, 5)).totals.trainable == 12


class _ClipsItself(nn.Linear):
    """Weight clipping inside the forward: the module changes its own weight in place."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def test_state_kept_says_which_parameters_the_forward_changed_in_place():
    """Parameters are not copied (a second copy of the weights): one the forward changes in
    place stays changed, and state_kept says so by name (products that run the model, such as
    hs.summary, left it changed silently); a forward that changes none says nothing."""
    torch.manual_seed(0)
    net = nn.Sequential(_ClipsItself(4, 4), nn.Tanh())
    with pytest.warns(
        hs.HookscopeWarning, match=r"changed its own parameters in place \('0\.weight'"
    ):
        hs.summary(net, torch.randn(2, 4))
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with state_kept(plain):
            plain(torch.randn(2, 4)).sum().backward()


class _Rewrites(nn.Linear):
    """A forward that deletes a plain attribute, adds a plain one, a tensor one and an object,
    and replaces an object attribute by a number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        del self.label
        self.added_count = 3
        self.added_tensor = x.sum()
        self.added_object = object()
        self.helper = 1.5
        return super().forward(x)


def test_attributes_deleted_added_or_retyped_by_the_forward_are_put_back_by_name():
    """Checked against the module's ``__dict__`` copied by hand before the forward: a plain
    attribute deleted comes back, plain ones added (a number, a tensor) are removed, an object
    added is left (not state the restore knows), an object the forward replaced by a number
    comes back (the restore deleted the attribute: the module lost it)."""
    m = _Rewrites(2, 2)
    m.label, m.helper = "first", object()
    before = dict(m.__dict__)
    with state_kept(m):
        m(torch.ones(1, 2))
    assert m.label == "first"
    assert not hasattr(m, "added_count") and not hasattr(m, "added_tensor")
    assert hasattr(m, "added_object")
    assert {k: v for k, v in m.__dict__.items() if k != "added_object"} == before
