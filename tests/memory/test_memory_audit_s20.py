"""Audit s20 of memory_profile: figures against hand counts where the step frees a graph during
forward, or runs a layer in another thread."""

from __future__ import annotations

import threading
import weakref

import pytest
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


class Threaded(nn.Module):
    """A forward that runs its middle block in a thread of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 64)
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.c = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: out.append(self.b(h)))
        worker.start()
        worker.join()
        return self.c(out[0])


def _saved_in_every_thread(model: Threaded, x: torch.Tensor) -> int:
    """Bytes of the unique non-parameter storages saved in the step, with a pack hook opened in
    the worker thread too (``saved_tensors_hooks`` is per thread)."""
    own = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t.detach()

    block = model.b.forward

    def hooked(*args):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return block(*args)

    model.b.forward = hooked
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum().backward()
    finally:
        del model.b.forward
        model.zero_grad(set_to_none=True)
    return sum(seen.values())


def test_a_layer_run_in_another_thread_is_named_not_left_out_silently() -> None:
    model, x = Threaded(), torch.randn(3, 8)
    # x (3*8 floats), h (3*64) saved by b.0, tanh's output (3*64) saved by b.1 and c
    assert _saved_in_every_thread(model, x) == 4 * (3 * 8 + 2 * 3 * 64)
    with pytest.warns(hs.HookscopeWarning) as got:
        prof = hs.memory_profile(model, x)
    (w,) = [w for w in got if "thread" in str(w.message)]
    text = str(w.message)
    assert "'b'" in text and "'b.0'" not in text  # the outermost layer, once
    assert "calling thread" in text  # the fix
    # what the hooks of the calling thread saw: the worker's saves are in no row
    assert prof.total_saved_bytes == 4 * (3 * 8 + 3 * 64)
    assert prof["b"].calls == 0


def test_a_capture_open_around_the_profile_neither_sees_its_step_nor_adds_to_its_peaks() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)), torch.randn(3, 8)
    # by hand, alive when the loss is computed (also the forward peak): Linear 0's output (saved
    # by GELU), GELU's output (saved by Linear 2), the output, the loss
    by_hand = 3 * 16 * 4 + 3 * 16 * 4 + 3 * 2 * 4 + 4
    with hs.capture(model, "*") as cap:
        prof = hs.memory_profile(model, x)
        assert (prof.peak_forward_bytes, prof.live_bytes_end_forward) == (by_hand, by_hand)
        assert prof.total_saved_bytes == 3 * 8 * 4 + 2 * 3 * 16 * 4
        with pytest.raises(hs.HookscopeError, match="'0'"):
            cap["0"]  # the profile's step is its own run, not one of the user's calls
        out = model(x)
        assert torch.equal(cap["2"], out)  # the user's own call is captured
