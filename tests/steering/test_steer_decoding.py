"""Audit of silent wrong results in steering: each test fails on the code before its fix and
checks the steered run against a hand-written hook over the final sequence."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import tiny_gpt2, word_tokenizer

LAYER, READ = "transformer.h.0", "transformer.h.1"
# repeats itself, so that prompt-lookup decoding finds candidates in it
PROMPT = "the cat went to the park and the cat went to the park and the cat"


def _hand_reference(model, v, scale, ids, chosen):
    """One forward over ``ids`` with a plain hook adding ``scale * v`` where ``chosen``."""

    def add(m, a, out):
        return out + scale * v * chosen[..., None]

    handle = model.get_submodule(LAYER).register_forward_hook(add)
    try:
        with hs.capture(model, READ) as ref:
            model(input_ids=ids)
    finally:
        handle.remove()
    return ref[READ]


@pytest.mark.parametrize("positions", ["generated", "prompt", -2])
@pytest.mark.parametrize("how", ["prompt_lookup", "no_cache"])
def test_steer_positions_in_generate_do_not_depend_on_the_decoding(positions, how):
    # Prompt-lookup decoding runs the prompt and its first candidates in one call: that call was
    # taken for the prompt, so 'generated' missed the first generated tokens (and 'prompt' steered
    # them). Without the cache each call re-runs the whole sequence, and -k steered the last k
    # tokens of each call only, not "the prompt's last k, then every generated token".
    model = tiny_gpt2(n_layer=2)
    enc = word_tokenizer("left")([PROMPT], return_tensors="pt")
    n = enc["input_ids"].shape[1]
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    kw = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"use_cache": False}
    with (
        hs.steer(model, {LAYER: v}, scale=2.0, positions=positions),
        hs.capture(model, READ, sequence=True) as cap,
    ):
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=None, **kw)
    ids = out[:, :-1]
    col = torch.arange(ids.shape[1])[None]
    chosen = {"generated": col >= n, "prompt": col < n, -2: col >= n - 2}[positions]
    ref = _hand_reference(model, v, 2.0, ids, chosen)
    got = cap.sequence(READ).values[:, : ids.shape[1]]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with hs.steer(model, {LAYER: v}, scale=2.0, positions=positions):
        greedy = model.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(greedy, out)


def test_the_model_is_left_as_found_and_copies_generate_as_transformers_does():
    # steer and capture(sequence=True) learn the prompt's width from generate(): the model's
    # generate is wrapped while a scope is open, for both scopes at once, and put back after
    import copy

    model = tiny_gpt2(n_layer=2)
    enc = word_tokenizer("left")([PROMPT], return_tensors="pt")
    v = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with hs.capture(model, READ, sequence=True) as cap:
        with hs.steer(model, {LAYER: v}, positions="generated"):
            assert "generate" in model.__dict__
            twin = copy.deepcopy(model)
            assert "generate" not in twin.__dict__ or twin.generate.__self__ is twin
            out = model.generate(**enc, max_new_tokens=3, do_sample=False, eos_token_id=None)
        assert "generate" in model.__dict__  # the capture's, still open
    assert "generate" not in model.__dict__
    assert cap.sequence(READ).values.shape[1] == out.shape[1] - 1
    plain = twin.generate(**enc, max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert plain.shape == out.shape
    with hs.steer(twin, {LAYER: v}, positions="generated"):  # the copy's scopes wrap it too
        assert type(twin.__dict__["generate"]).__name__ == "_Generate"
        twin.generate(**enc, max_new_tokens=2, do_sample=False, eos_token_id=None)
    assert "generate" not in twin.__dict__  # the class's own method again
    assert hs.hooks_on(model) == []


def _prefix_cached():
    """A tiny GPT-2, a 7-token prompt, a steering vector, and a cache holding the prompt's first
    4 tokens (computed before any scope)."""
    from transformers import DynamicCache

    model = tiny_gpt2(n_layer=2)
    ids = word_tokenizer()(["the cat went to the park and"], return_tensors="pt")["input_ids"]
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache, use_cache=True)
    return model, ids, v, cache


def _assert_logits_steered_at(model, got, v, chosen, width):
    """The logits of each token ``generate`` made (``got``) equal one forward of the whole
    sequence with a hand hook adding ``2 * v`` at the ``chosen`` columns."""

    def add(m, a, o):
        return o + 2.0 * v * chosen[..., None]

    handle = model.get_submodule(LAYER).register_forward_hook(add)
    try:
        with torch.no_grad():
            ref = model(got.sequences[:, :-1]).logits
    finally:
        handle.remove()
    for i, logits in enumerate(got.logits):
        torch.testing.assert_close(logits, ref[:, width - 1 + i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", ["generated", -2])
def test_steer_positions_with_a_cache_that_holds_the_prompts_first_tokens(positions):
    # generate(ids, past_key_values=cache) with a cache that already holds the prompt's first 4
    # tokens runs the other prompt tokens in its first call, which was not taken for a prompt:
    # 'generated' steered those prompt tokens too, silently.
    model, ids, v, cache = _prefix_cached()
    width = ids.shape[1]
    with hs.steer(model, {LAYER: v}, scale=2.0, positions=positions):
        got = model.generate(
            ids,
            past_key_values=cache,
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    col = torch.arange(got.sequences.shape[1] - 1)[None]
    chosen = col >= (width if positions == "generated" else width - 2)
    _assert_logits_steered_at(model, got, v, chosen, width)


@pytest.mark.parametrize(
    "positions", [20, torch.zeros(6, dtype=torch.bool), torch.tensor([False, False, True])]
)
def test_steer_positions_that_select_no_token_warn(positions):
    # positions=k past every row's end, or a mask selecting no token that ran, steered nothing and
    # said nothing (an int or a mask was not checked: 'it would need a host sync per call'; one
    # sync at exit suffices). The mask [F, F, T] over 2-token prompts selects none of them.
    model = tiny_gpt2(n_layer=2)
    ids = torch.tensor([[3, 4], [5, 6]])
    v = torch.ones(64)
    with (
        pytest.warns(hs.HookscopeWarning, match="no position was steered"),
        hs.steer(model, {LAYER: v}, positions=positions),
    ):
        model(ids)
    with hs.capture(model, READ) as plain:
        model(ids)
    with hs.steer(model, {LAYER: v}, positions=1), hs.capture(model, READ) as steered:  # no warning
        model(ids)
    assert (steered[READ] - plain[READ])[:, 1].abs().max() > 1e-3


def _tiny_bloom():
    from transformers import BloomConfig, BloomForCausalLM

    from helpers.lm import EOS, PAD, WORDS

    cfg = BloomConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        n_layer=2,
        n_head=4,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return BloomForCausalLM(cfg).eval()


def test_a_static_cache_mask_as_wide_as_its_buffer_is_read_not_refused():
    # Bloom builds ALiBi from a 2-D mask, which its generate() pads to the static cache's buffer:
    # every call was refused ("its attention mask is 10 columns wide for 6 new tokens, but the
    # KV cache held 0 tokens"), capture(sequence=True) and steer(positions=...) alike.
    from helpers.lm import PROMPTS, final_forward_inputs

    model = _tiny_bloom()
    layer, read = "transformer.h.0", "transformer.h.1"
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    with (
        hs.steer(model, {layer: v}, scale=0.5, positions=3),
        hs.capture(model, read, sequence=True) as cap,
    ):
        out = model.generate(
            **enc,
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            cache_implementation="static",
        )
    seq = cap.sequence(read)
    kw = final_forward_inputs(model, out, enc["attention_mask"])
    amask = kw["attention_mask"]
    chosen = ((amask.cumsum(1) - 1) >= 3) & amask.bool()

    def add(m, a, o):
        return (o[0] + 0.5 * v * chosen[..., None], *o[1:]) if isinstance(o, tuple) else o

    handle = model.get_submodule(layer).register_forward_hook(add)
    try:
        with hs.capture(model, read) as ref:
            model(**kw)
    finally:
        handle.remove()
    want = ref[read][0] if isinstance(ref[read], tuple) else ref[read]
    for b in range(2):
        n = int(amask[b].sum())
        assert seq.tokens[b, :n].tolist() == kw["input_ids"][b][amask[b].bool()].tolist()
        torch.testing.assert_close(seq.values[b, :n], want[b][amask[b].bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["prompt", 1, -6])
def test_steer_positions_that_choose_tokens_cached_before_the_scope_warn(positions):
    # the cache passed to generate() already holds the prompt's first 4 tokens, computed before
    # the scope opened: 'prompt', k=1 and the prompt's last 6 choose some of them, which nothing
    # can steer (the cache keeps their unsteered keys and values); it was silent. Checked: the
    # generated tokens' logits equal a run steering only the tokens from column 4 on.
    model, ids, v, cache = _prefix_cached()
    width = ids.shape[1]
    with (
        pytest.warns(hs.HookscopeWarning, match=r"first 4 tokens, which the model computed before"),
        hs.steer(model, {LAYER: v}, scale=2.0, positions=positions),
    ):
        got = model.generate(
            ids, past_key_values=cache, max_new_tokens=2, do_sample=False, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    col = torch.arange(got.sequences.shape[1] - 1)[None]
    if positions == "prompt":
        chosen = (col >= 4) & (col < width)
    elif positions == 1:
        chosen = col >= 4
    else:
        chosen = (col >= 4) & (col >= width - 6)
    _assert_logits_steered_at(model, got, v, chosen, width)


def test_a_plain_forward_over_a_cache_steering_each_call_s_last_token_does_not_warn():
    # -1 outside generate(): each call's last token, which the call computes: nothing unseen
    from transformers import DynamicCache

    model = tiny_gpt2(n_layer=2)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache, use_cache=True)
        with hs.steer(model, {LAYER: torch.ones(64)}, positions=-1):
            model(ids[:, 4:], past_key_values=cache, use_cache=True)
