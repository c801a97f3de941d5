"""A model holding a sparse COO buffer (a graph's adjacency) through the products that keep the
model's state (summary, compare): kept and compared by its indices and values (``torch.equal``
has no sparse kernel: they raised NotImplementedError from deep inside)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.core._buffers import buffers_kept, same_tensor

N = 6


def _adjacency(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(N, N, generator=g)
    d[d < 0.6] = 0
    return d.to_sparse()


class GraphConv(nn.Module):
    def __init__(self, adj: torch.Tensor, bump: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("adj", adj)
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bump:  # a forward that changes its sparse buffer in place (a running graph)
            self.adj.mul_(2)
        return torch.sparse.mm(self.adj, self.lin(x))


class Net(nn.Module):
    def __init__(self, bump: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.graph = GraphConv(_adjacency(0), bump)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.graph(x)))


X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))


def test_summary_of_a_model_with_a_sparse_buffer_keeps_it() -> None:
    model = Net(bump=True)
    before = model.graph.adj.to_dense().clone()
    ref = copy.deepcopy(model)(X)  # the reference: a plain forward of an untouched copy
    s = hs.summary(model, X)
    buf = model.graph.adj
    assert buf.layout is torch.sparse_coo and torch.equal(buf.to_dense(), before)
    assert torch.equal(model(X), ref)  # the summary's run left no trace in the buffer
    nnz = int((before != 0).sum())
    assert s.totals.buffer_bytes == 2 * nnz * 8 + nnz * 4  # indices + values, not N*N floats
    assert [r.name for r in s.rows][:3] == ["", "graph", "graph.lin"]


def test_compare_of_models_with_sparse_buffers() -> None:
    a = Net()
    same = hs.compare(a, copy.deepcopy(a), X, loss_fn=lambda o: o.pow(2).sum())
    assert same.culprit is None and all(r.error in (None, 0.0) for r in same.rows)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.graph.adj._values().mul_(1.5)  # a planted fault in B's adjacency
    ref_a, ref_b = a(X), b(X)  # the reference: the two plain forwards differ
    assert not torch.allclose(ref_a, ref_b)
    report = hs.compare(a, b, X, loss_fn=lambda o: o.pow(2).sum())
    assert report.culprit == "graph"
    assert torch.equal(b(X), ref_b) and torch.equal(a(X), ref_a)  # both kept


def test_buffers_kept_puts_back_a_sparse_buffer_changed_or_reassigned() -> None:
    m = GraphConv(_adjacency(2))
    held = m.adj
    want = held.to_dense().clone()
    idx, vals = held._indices().clone(), held._values().clone()
    with buffers_kept(m):
        m.adj.mul_(3)  # in place
    assert m.adj is held and torch.equal(held.to_dense(), want)
    assert torch.equal(held._indices(), idx) and torch.equal(held._values(), vals)
    with buffers_kept(m):
        m.adj = _adjacency(3)  # reassigned
    assert m.adj is held and torch.equal(held.to_dense(), want)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: d.to_sparse(),
        lambda d: d.to_sparse_csr(),
        lambda d: d.to_sparse_csc(),
        lambda d: d.to_sparse_bsr((2, 2)),
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
def test_same_tensor_against_the_dense_values(make) -> None:
    g = torch.Generator().manual_seed(4)
    d = torch.rand(4, 6, generator=g)
    d[d < 0.5] = 0
    e = d.clone()
    e[d != 0] += 1  # the same pattern, other values
    assert same_tensor(make(d), make(d.clone()))
    assert not same_tensor(make(d), make(e))
    assert not same_tensor(make(d), d)  # another layout
