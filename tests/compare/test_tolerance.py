"""compare/_tolerance.py: the relative errors every row reads, against float64 computed here by
hand; pairs stacked with the pairs of their size (an empty one included) give what one pair at
a time gives, and a pair that is not finite takes the careful path whether or not it is
stacked."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

tol = importlib.import_module("hookscope.compare._tolerance")


def _ref(pairs) -> float:
    num = den = 0.0
    for x, y in pairs:
        xd, yd = x.double(), y.double()
        num += float((yd - xd).pow(2).sum())
        den += float(xd.pow(2).sum())
    return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, dy in [(16, torch.bfloat16), (16, torch.bfloat16), (16, torch.bfloat16),
                  (300, torch.float16), (300, torch.float16), (7, torch.float32),
                  (tol._GROUP + 5, torch.bfloat16), (16, torch.float32), (0, torch.bfloat16),
                  (40, torch.bfloat16), (16, torch.bfloat16)]:  # fmt: skip
        x = torch.randn(n, generator=g)
        y = (x + 1e-2 * torch.randn(n, generator=g)).to(dy)
        out.append((x, y))
    return out


def test_each_error_is_the_float64_norm_ratio_stacked_or_not():
    pairs = _pairs(0)
    norms = tol.Norms()
    lazies = [norms.rel_pairs([p]) for p in pairs]
    joint = norms.rel_pairs(pairs)
    norms.resolve()
    for lz, p in zip(lazies, pairs):
        assert lz.get() == pytest.approx(_ref([p]), rel=1e-5)
    assert joint.get() == pytest.approx(_ref(pairs), rel=1e-5)
    # one pair at a time (no group) gives the same
    for p in pairs:
        assert tol.rel_pairs([p]) == pytest.approx(_ref([p]), rel=1e-5)


def test_equal_values_give_exactly_zero_and_other_shapes_or_integers_give_inf():
    x = torch.randn(4, 4)
    norms = tol.Norms()
    same = [norms.rel_pairs([(x, x.clone())]) for _ in range(3)]  # a group of three
    norms.resolve()
    assert all(s.get() == 0.0 for s in same)
    assert tol.rel_pairs([(x, x.reshape(16))]) == math.inf
    ids = torch.arange(5)
    assert tol.rel_pairs([(ids, ids.clone())]) is None  # integers: equal, nothing to add
    assert tol.rel_pairs([(ids, ids + 1)]) == math.inf
    assert tol.rel_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(0.1)


def test_a_pair_that_is_not_finite_takes_the_careful_path_inside_a_group():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=g)
    y = x + 1e-3 * torch.randn(3, 16, generator=g)
    x_inf, y_inf = x[1].clone(), y[1].clone()
    x_inf[3] = y_inf[3] = math.inf  # the same pattern: the finite part is compared
    y_nan = y[2].clone()
    y_nan[0] = math.nan  # only in y: they cannot agree
    norms = tol.Norms()
    ok = norms.rel_pairs([(x[0], y[0])])
    agree = norms.rel_pairs([(x_inf, y_inf)])
    nan = norms.rel_pairs([(x[2], y_nan)])
    norms.resolve()
    assert ok.get() == pytest.approx(_ref([(x[0], y[0])]), rel=1e-5)
    keep = torch.arange(16) != 3
    assert agree.get() == pytest.approx(_ref([(x_inf[keep], y_inf[keep])]), rel=1e-5)
    assert nan.get() == math.inf


def test_a_value_on_one_side_only_counts_as_zeros_when_asked():
    x = torch.randn(8)
    norms = tol.Norms()
    skipped = norms.rel_pairs([(x, None)])
    zero = norms.rel_pairs([(x, None)], missing=True)
    norms.resolve()
    assert skipped is None and zero.get() == pytest.approx(1.0)


def test_the_pending_pairs_resolve_by_themselves_past_the_budget():
    norms = tol.Norms(budget=1000)
    x = torch.randn(200)
    first = norms.rel_pairs([(x, x * 1.5)])  # 1600 bytes: over the budget, resolved at once
    assert norms._x == [] and first.get() == pytest.approx(0.5, rel=1e-6)


def test_large_pairs_sharing_their_reference_each_read_their_own_values():
    """The norm of a reference read by several large pairs (a call's output: its row's, its
    replay's and the next call's input) is taken once per memory it reads: the same object, a
    view of it, and another tensor of the same shape each give their own exact ratio."""
    g = torch.Generator().manual_seed(4)
    n = tol._GROUP + 3
    x, other = torch.randn(n, generator=g), torch.randn(n, generator=g)
    pairs = [(x, x + 1e-2 * torch.randn(n, generator=g)) for _ in range(2)]
    pairs += [(x.view_as(x), x * 1.5), (other, other * 0.5), (x[1:], x[1:] * 2.0)]
    norms = tol.Norms()
    errs = [norms.rel_pairs([p]) for p in pairs]
    norms.resolve()
    for e, p in zip(errs, pairs):
        assert e.get() == pytest.approx(_ref([p]), rel=1e-5)
