"""Audit s20 of memory_profile: figures against hand counts where the step frees a graph during
forward."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

import hookscope as hs


class SideStatistic(nn.Module):
    """A forward that computes a statistic with autograd on and keeps only its number: the graph
    of ``exp`` (which saves its 4x256 float64 result, 8192 bytes) is freed on the spot."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c = nn.Linear(8, 256), nn.Linear(256, 1024)
        self.stat = 0.0
        self.exp_result: weakref.ref | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        e = h.double().exp()
        self.exp_result = weakref.ref(e.untyped_storage())
        self.stat = float(e.detach().mean())  # only the number is kept
        del e
        return self.c(torch.tanh(h))


def _kept_by_hand(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique non-parameter storages held for backward when the forward is over: a
    plain ``saved_tensors_hooks`` pack (``detach``, as PyTorch's docs ask) and a weak reference to
    each packed tensor, alive while the graph that saved it is."""
    own = {t.untyped_storage().data_ptr() for t in model.parameters()}
    packed: list[tuple[weakref.ref, int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        st = t.untyped_storage()
        packed.append((weakref.ref(d), st.data_ptr(), st.nbytes()))
        return d

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    kept = {ptr: n for r, ptr, n in packed if r() is not None and ptr not in own}
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def test_a_graph_freed_during_forward_is_freed_under_the_profile_and_not_counted() -> None:
    model, x = SideStatistic(), torch.randn(4, 8)
    expected = _kept_by_hand(model, x)
    # by hand: a saves x (4*8 floats); tanh its output, which c saves too (4*256 floats)
    assert expected == 4 * 8 * 4 + 4 * 256 * 4
    alive: list[bool] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        alive.append(model.exp_result() is not None)
        return out.sum()

    # without hookscope the exp result is freed before the loss
    loss_fn(model(x))
    assert alive == [False]
    prof = hs.memory_profile(model, x, loss_fn=loss_fn)
    assert alive == [False, False]  # the profile does not keep it alive (it did: a cycle)
    assert prof.total_saved_bytes == expected
    assert prof["a"].saved_bytes == 4 * 8 * 4
    assert prof[""].saved_bytes == 4 * 256 * 4  # tanh is the root's own operation
    assert prof["c"].saved_bytes == 0  # its input is tanh's output, counted at the root
    # live when the loss is computed: tanh's output, c's output, the loss (h is freed with the
    # forward's locals); the forward peak is at c's output: h, tanh's output and c's output
    assert prof.live_bytes_end_forward == 4 * 256 * 4 + 4 * 1024 * 4 + 4
    assert prof.peak_forward_bytes == 2 * 4 * 256 * 4 + 4 * 1024 * 4
