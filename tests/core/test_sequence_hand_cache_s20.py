"""``capture(sequence=True)`` on a model of its own with a hand-written KV cache: each decoding call
of one token read as a new sequence at position 0, so ``sequence()`` put every generated token in a
sequence of its own, silently. Now the call is refused by ``sequence()`` (naming the call and
what carries the state), a cache the modules keep is said, and the cases without carried state
assemble exactly (against a hand-written hook on a forward over the same tokens)."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import HandCacheLM

IDS = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))


def _hand(model, ids):
    """blocks.1's output over ``ids`` in one forward, by a plain hook."""
    got = []
    handle = model.blocks[1].register_forward_hook(lambda m, a, out: got.append(out.detach()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return got[0]


@pytest.mark.parametrize("style", ["dict", "returned"])
def test_sequence_refuses_a_decoding_call_with_a_hand_written_cache(style):
    model = HandCacheLM(style).eval()
    with hs.capture(model, "blocks.1", sequence=True) as cap:
        model.decode(IDS, 3)
    with pytest.raises(hs.SequenceError, match="model call 1 cannot be placed .* hand-written KV"):
        cap.sequence("blocks.1")


def test_sequence_says_a_cache_the_modules_keep():
    model = HandCacheLM("modules").eval()
    said = pytest.warns(hs.HookscopeWarning, match="changed the model's own tensors in place")
    with said, hs.capture(model, "blocks.1", sequence=True):
        model.decode(IDS, 3)


@pytest.mark.parametrize("style", ["dict", "returned", "modules"])
def test_sequence_of_a_loop_without_a_cache_is_exact(style):
    model = HandCacheLM(style).eval()
    with hs.capture(model, "blocks.1", sequence=True) as cap:
        seq = model.decode(IDS, 4, cached=False)
    got = cap.sequence("blocks.1")
    want = _hand(model, seq[:, :-1])  # (the last token never ran)
    assert got.values.shape == want.shape
    assert torch.equal(got.values, want)
