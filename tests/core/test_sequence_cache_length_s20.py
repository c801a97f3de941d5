"""A call given a real cache whose length cannot be read (a state-space model's DynamicCache of
linear-attention layers raises in get_seq_length), with no mask, no cache_position and no call
before it in the scope: its start was taken as 0 without a word; now refused by name."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import tiny_mamba

LAYER = "backbone.layers.1"
IDS = torch.tensor([[5, 9, 12, 7, 3, 14]])


def _prefilled(model):
    with torch.no_grad():
        cache = model(IDS[:, :4], use_cache=True).cache_params
    with pytest.raises(ValueError, match="get_seq_length"):
        cache.get_seq_length()  # the case: a real cache whose length cannot be read
    return cache


def test_a_prefilled_cache_of_unreadable_length_is_refused() -> None:
    model = tiny_mamba()
    cache = _prefilled(model)
    with hs.capture(model, LAYER, sequence=True) as cap, torch.no_grad():
        model(IDS[:, 4:], cache_params=cache, use_cache=True)
    with pytest.raises(hs.SequenceError, match=r"model call 0 .*DynamicCache that already holds"):
        cap.sequence(LAYER)


def test_the_same_calls_inside_the_scope_are_placed() -> None:
    """The prompt's call inside the scope: the continuation is placed after it; the sequence
    equals the two calls' outputs side by side (a hand-written hook on the same calls)."""
    model = tiny_mamba()
    got = []
    handle = model.backbone.layers[1].register_forward_hook(lambda m, a, o: got.append(o))
    try:
        with hs.capture(model, LAYER, sequence=True) as cap, torch.no_grad():
            cache = model(IDS[:, :4], use_cache=True).cache_params
            model(IDS[:, 4:], cache_params=cache, use_cache=True)
    finally:
        handle.remove()
    seq = cap.sequence(LAYER)
    assert seq.tokens.tolist() == IDS.tolist() and seq.mask.all()
    assert torch.equal(seq.values, torch.cat(got, 1))


def test_steer_refuses_the_same_call_where_its_position_matters() -> None:
    model = tiny_mamba()
    cache = _prefilled(model)
    vec = {LAYER: torch.ones(model.config.hidden_size)}
    refused = pytest.raises(
        hs.HookscopeError, match=r"steer\(positions=2\): model call 0: .*already holds state"
    )
    with refused, hs.steer(model, vec, positions=2), torch.no_grad():
        model(IDS[:, 4:], cache_params=cache, use_cache=True)
