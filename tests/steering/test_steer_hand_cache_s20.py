"""``steer`` on a model of its own with a hand-written KV cache (no Hugging Face cache, no
attention mask, no ``cache_position``): a decoding call of one token used to read as a new
sequence at position 0, so ``positions=3`` steered no generated token and ``"prompt"`` steered
every one, silently. Such a call is now refused where its position matters (naming the call and
what carries the state), and steered exactly where it does not: ``"all"``, negative positions
(checked against a hand-written hook on the same run), a loop without a cache, separate prompts
with a fresh cache each."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hookscope as hs
from helpers.lm import HandCacheLM

IDS = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))
VEC = torch.randn(16, generator=torch.Generator().manual_seed(1))


def _hand(model, select):
    """A plain forward hook adding 3 * VEC to blocks.0's output where ``select(call's width)``."""

    def hook(module, args, out):
        sel = select(out.shape[1])
        return out + 3.0 * VEC * sel[None, :, None].to(out.dtype)

    return model.blocks[0].register_forward_hook(hook)


@pytest.mark.parametrize("style", ["dict", "returned"])
@pytest.mark.parametrize(
    "positions", [3, "prompt", "generated", torch.ones(2, 12, dtype=torch.bool)]
)
def test_a_decoding_call_with_a_hand_written_cache_is_refused_where_its_position_matters(
    style, positions
):
    model = HandCacheLM(style).eval()
    what = {
        "dict": "a dict given to the call before, which changed it",
        "returned": "a dict the call before returned",
    }[style]
    refused = pytest.raises(hs.HookscopeError, match=f"model call 1: .*{what}")
    with refused, hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=positions):
        model.decode(IDS, 3)


def test_a_cache_the_modules_keep_is_said():
    """A cache the modules keep (Meta's reference Llama): a decoding step and a new prompt at 0
    look alike, so the call is not refused; a warning names the tensors and the fix."""
    model = HandCacheLM("modules").eval()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"model call 1 \(1 token\(s\)\) .* "
            r"\(blocks.0.attn.cache_k, blocks.0.attn.cache_v, blocks.1.attn.cache_k \.\.\.\)",
        ),
        hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=3),
    ):
        model.decode(IDS, 3)


@pytest.mark.parametrize("style", ["dict", "returned", "modules"])
@pytest.mark.parametrize("k", [-1, -2])
def test_negative_positions_and_all_steer_a_hand_cached_loop_exactly(style, k):
    model = HandCacheLM(style).eval()
    with hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=k):
        got = model.decode(IDS, 4)
    handle = _hand(model, lambda n: torch.arange(n) >= n + k)  # the last -k of each call
    try:
        want = model.decode(IDS, 4)
    finally:
        handle.remove()
    assert torch.equal(got, want)
    with hs.steer(model, {"blocks.0": VEC}, scale=3.0):
        got = model.decode(IDS, 4)
    handle = _hand(model, lambda n: torch.ones(n, dtype=torch.bool))
    try:
        want = model.decode(IDS, 4)
    finally:
        handle.remove()
    assert torch.equal(got, want)


@pytest.mark.parametrize("style", ["dict", "modules"])
def test_no_false_refusal_without_carried_state(style):
    model = HandCacheLM(style).eval()
    # a loop without a cache: each call runs the whole sequence again from position 0
    with hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=3):
        got = model.decode(IDS, 4, cached=False)
    handle = _hand(model, lambda n: torch.arange(n) >= 3)
    try:
        want = model.decode(IDS, 4, cached=False)
    finally:
        handle.remove()
    assert torch.equal(got, want)
    # separate prompts in one scope, a fresh cache each (modules: a new prompt written at 0 each
    # time, the same tokens again reading as a re-run): each a new sequence, steered from 3 on
    other = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(5))
    outs = []
    said = (
        pytest.warns(hs.HookscopeWarning, match="model call 1 .* changed the model's own tensors")
        if style == "modules"  # (a new prompt and a decoding step look alike there: said)
        else contextlib.nullcontext()
    )
    with said, hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=3), torch.no_grad():
        for ids in (IDS, other):
            outs.append(model(ids, cache={}) if style == "dict" else model(ids))
    handle = _hand(model, lambda n: torch.arange(n) >= 3)
    try:
        with torch.no_grad():
            refs = [model(ids, cache={}) if style == "dict" else model(ids) for ids in (IDS, other)]
    finally:
        handle.remove()
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)


def test_a_dict_of_plain_values_passed_to_every_call_is_no_cache():
    class Logged(HandCacheLM):
        def forward(self, input_ids, log=None, start=0):
            log["calls"] = log.get("calls", 0) + 1  # changed by every call, holds no tensor
            return super().forward(input_ids, start=start)

    model = Logged("dict").eval()
    log: dict = {}
    with hs.steer(model, {"blocks.0": VEC}, scale=3.0, positions=2), torch.no_grad():
        a = model(IDS, log=log)
        b = model(IDS[:, :4], log=log)
    handle = _hand(model, lambda n: torch.arange(n) >= 2)
    try:
        with torch.no_grad():
            assert torch.equal(a, model(IDS, log={})) and torch.equal(b, model(IDS[:, :4], log={}))
    finally:
        handle.remove()
    assert log == {"calls": 2}
