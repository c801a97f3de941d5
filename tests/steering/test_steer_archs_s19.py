"""Steering and ``capture(sequence=True)`` on architectures beyond the GPT-2/Llama family, each
checked against a plain PyTorch hook written by hand on the same run, or a forward without the
cache (random weights, CPU, nothing downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hookscope as hs
from helpers.lm import (
    PROMPTS,
    final_forward_inputs,
    tiny_decoder,
    tiny_falcon_alibi,
    tiny_gpt2,
    tiny_mamba2,
    tiny_mpt,
    word_tokenizer,
)

NEW = 5  # tokens generated


def _vector(model):
    return torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3


class _HandSteer:
    """A plain forward hook adding ``2 * v`` at the positions that ``positions`` names, read from
    the 2-D attention mask of each model call (``generate`` passes one over the whole sequence
    so far, also without a cache): the reference, written without hookscope."""

    def __init__(self, model, layer, v, positions, prompt_mask):
        self.v, self.positions = v, positions
        self.width = prompt_mask.shape[1]
        self.prompt_len = prompt_mask.sum(1)
        self.handles = [
            model.register_forward_pre_hook(self.pre, with_kwargs=True),
            model.get_submodule(layer).register_forward_hook(self.add),
        ]

    def pre(self, module, args, kwargs):
        self.mask, self.n = kwargs["attention_mask"], kwargs["input_ids"].shape[1]

    def add(self, module, args, out):
        mask = self.mask
        real, pos = mask.bool(), mask.cumsum(1) - 1  # pos: real tokens before each column
        col = torch.arange(mask.shape[1])[None]
        p = self.positions
        if p == "generated":
            chosen = (col >= self.width).expand_as(real)
        elif p == "prompt":
            chosen = (col < self.width) & real
        elif p >= 0:  # k: each row's k-th real token and later
            chosen = (pos >= p) & real
        else:  # -k: each prompt's last k real tokens, then every generated token
            rows = mask.shape[0] // len(self.prompt_len)
            chosen = (pos >= self.prompt_len.repeat_interleave(rows)[:, None] + p) & real
        chosen = chosen[:, mask.shape[1] - self.n :]
        h = out[0] if isinstance(out, tuple) else out
        h = h + 2.0 * self.v * chosen[..., None]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def remove(self):
        for h in self.handles:
            h.remove()


def _beams(model, enc, **kw):
    return model.generate(
        **enc,
        max_new_tokens=NEW,
        num_beams=2,
        do_sample=False,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )


@pytest.mark.parametrize("positions", ["generated", "prompt", -2])
@pytest.mark.parametrize("arch", ["mpt", "gpt2_no_cache"])
def test_steer_in_beam_search_without_a_cache_equals_a_hand_hook(arch, positions):
    # Without a cache each beam-search step re-runs the whole sequence with its rows reordered:
    # the call was taken for a new prompt (its tokens did not continue the previous call row by
    # row), so 'generated' steered only the first step, 'prompt' steered the generated tokens
    # too, and -2 the last 2 tokens of each call. MPT decodes so by default (use_cache=False).
    model = tiny_mpt() if arch == "mpt" else tiny_gpt2(n_layer=2)
    kw = {} if arch == "mpt" else {"use_cache": False}
    layer = "transformer.blocks.0" if arch == "mpt" else "transformer.h.0"
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    v = _vector(model)
    with hs.steer(model, {layer: v}, scale=2.0, positions=positions):
        got = _beams(model, enc, **kw)
    hand = _HandSteer(model, layer, v, positions, enc["attention_mask"])
    try:
        ref = _beams(model, enc, **kw)
    finally:
        hand.remove()
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    plain = _beams(model, enc, **kw)  # the steering changed the scores
    assert any((a - b).abs().max() > 1e-2 for a, b in zip(plain.scores, ref.scores))


@pytest.mark.parametrize("arch", ["mpt", "gpt2_no_cache"])
def test_capture_sequence_in_beam_search_without_a_cache_equals_each_beams_forward(arch):
    # the same calls were taken for separate sequences: sequence() refused ("the capture saw 6
    # separate sequences (e.g. two generate() calls)") though one generate() ran
    model = tiny_mpt() if arch == "mpt" else tiny_gpt2(n_layer=2)
    kw = {} if arch == "mpt" else {"use_cache": False}
    read = "transformer.blocks.1" if arch == "mpt" else "transformer.h.1"
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    with hs.capture(model, read, sequence=True) as cap:
        _beams(model, enc, **kw)
    seq = cap.sequence(read)
    assert seq.values.shape[0] == 4
    for b in range(4):
        tokens = seq.tokens[b][seq.mask[b]]
        with hs.capture(model, read) as ref:
            model(input_ids=tokens[None])
        out = ref[read][0] if isinstance(ref[read], tuple) else ref[read]  # MPT: a tuple
        torch.testing.assert_close(seq.values[b][seq.mask[b]], out[0], atol=1e-5, rtol=0)
    assert seq.mask.sum(1).tolist() == [6 + NEW - 1] * 2 + [2 + NEW - 1] * 2


def test_mpt_greedy_without_a_cache_equals_one_hand_hooked_forward():
    # greedy MPT (no cache: each step re-runs the sequence) steered at 'generated' equals one
    # forward over the final sequence with a hand hook (exact before and after the fix)
    model = tiny_mpt()
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    v = _vector(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        with hs.steer(model, {"transformer.blocks.0": v}, scale=2.0, positions="generated"):
            out = model.generate(
                **enc,
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
    n = enc["input_ids"].shape[1]
    chosen = torch.arange(out.sequences.shape[1] - 1)[None] >= n

    def add(m, a, o):
        h = (o[0] if isinstance(o, tuple) else o) + 2.0 * v * chosen[..., None]
        return (h, *o[1:]) if isinstance(o, tuple) else h

    h = model.get_submodule("transformer.blocks.0").register_forward_hook(add)
    try:
        with torch.no_grad():
            kw = final_forward_inputs(model, out.sequences, enc["attention_mask"])
            ref = model(**kw).logits
    finally:
        h.remove()
    for i, lg in enumerate(out.logits):
        torch.testing.assert_close(lg, ref[:, n - 1 + i], atol=1e-5, rtol=0)


def _returned_cache(out):
    cache = getattr(out, "past_key_values", None)  # Mamba-2 returns it so, Mamba as cache_params
    return cache if cache is not None else out.cache_params


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_steer_a_hand_loop_of_cached_calls_on_a_state_space_model(arch):
    # A state-space model's cache has no length, and the decode calls pass no mask: a call was
    # placed after the previous one only when that one was given the same cache object. The
    # loop's first call is given none (the model makes it and returns it), so every later call
    # was taken for a new sequence from position 0: positions=3 steered none of the decode
    # calls, silently (logits 1e-2 to 1e-1 off the hand hook), and sequence() refused ("saw 2
    # separate sequences"). The cache a call returns is now the one the next call continues.
    from helpers.lm import tiny_mamba

    model = tiny_mamba() if arch == "mamba" else tiny_mamba2()
    layer, read = "backbone.layers.0", "backbone.layers.1"
    ids = torch.tensor([[3, 5, 11, 12, 3, 14, 15, 4, 16, 17]])
    v = _vector(model)
    with (
        hs.steer(model, {layer: v}, scale=2.0, positions=3),
        hs.capture(model, read, sequence=True) as cap,
        torch.no_grad(),
    ):
        out = model(ids[:, :5], use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(5, 10):
            out = model(ids[:, t : t + 1], cache_params=_returned_cache(out), use_cache=True)
            logits.append(out.logits[:, -1])
    chosen = torch.arange(10)[None] >= 3

    def add(m, a, o):
        return o + 2.0 * v * chosen[..., None]

    h = model.get_submodule(layer).register_forward_hook(add)
    try:
        with hs.capture(model, read) as ref, torch.no_grad():
            want = model(ids, use_cache=False).logits
    finally:
        h.remove()
    for i, lg in enumerate(logits):
        torch.testing.assert_close(lg, want[:, 4 + i], atol=1e-5, rtol=0)
    torch.testing.assert_close(cap.sequence(read).values, ref[read], atol=1e-5, rtol=0)


DECODERS = {
    # Gemma-3: a sliding-window layer (window 4 < the sequence) and a global one, softcapping
    "gemma3": lambda: tiny_decoder("gemma3"),
    "mixtral": lambda: tiny_decoder("mixtral"),
    "falcon_alibi": tiny_falcon_alibi,
    "phi3": lambda: tiny_decoder("phi3"),
    "mamba2": tiny_mamba2,
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_steer_and_sequence_in_generate_equal_one_hand_hooked_forward(arch, cache):
    # exact before and after the fixes above: what these architectures were checked for
    if arch == "falcon_alibi" and cache == "static":
        pytest.skip("Falcon's ALiBi does not run with a static cache in transformers")
    model = DECODERS[arch]()
    blocks = list(hs.blocks(model))
    layer, read = blocks[0], blocks[-1]
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    n = enc["input_ids"].shape[1]
    v = _vector(model)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, [1, 4, 7]] = mask[1, [0, 3, 5]] = True  # row b's p-th real token
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    for positions in (-2, mask):
        with (
            hs.steer(model, {layer: v}, scale=2.0, positions=positions),
            hs.capture(model, read, sequence=True) as cap,
        ):
            out = model.generate(
                **enc,
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
        ref_kw = final_forward_inputs(model, out.sequences, enc["attention_mask"])
        real = ref_kw["attention_mask"].bool()
        pos = ref_kw["attention_mask"].cumsum(1) - 1  # real tokens before each column
        if isinstance(positions, int):
            chosen = real & (pos >= enc["attention_mask"].sum(1, keepdim=True) + positions)
        else:
            chosen = real & mask.gather(1, pos.clamp(0, 11)) & (pos < 12)

        def add(m, a, o, chosen=chosen):
            h = (o[0] if isinstance(o, tuple) else o) + 2.0 * v * chosen[..., None]
            return (h, *o[1:]) if isinstance(o, tuple) else h

        h = model.get_submodule(layer).register_forward_hook(add)
        try:
            with hs.capture(model, read) as ref, torch.no_grad():
                want = model(**ref_kw, use_cache=False).logits
        finally:
            h.remove()
        for i, lg in enumerate(out.logits):
            torch.testing.assert_close(lg, want[:, n - 1 + i], atol=1e-5, rtol=0)
        seq = cap.sequence(read)
        r = ref[read][0] if isinstance(ref[read], tuple) else ref[read]
        for b in range(2):
            torch.testing.assert_close(seq.values[b][seq.mask[b]], r[b][real[b]], atol=1e-5, rtol=0)


def _greedy(model, enc, **kw):
    return model.generate(
        **enc,
        **kw,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )


def test_minimax_cache_length_is_read_from_its_attention_layers():
    # MiniMax's cache said it held 0 tokens at every call: in generate() each decode call was
    # refused ("its attention mask is 7 columns wide for 1 new tokens, but the KV cache held 0
    # tokens": blaming a mask that was right), and in a hand loop without a mask every call was
    # taken for a new sequence at position 0 (steer(positions=3) steered no decode call,
    # silently). The length is now the longest of the cache's layers when layer 0 says 0.
    model = tiny_decoder("minimax")
    layer = "model.layers.0"
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    v = _vector(model)
    with hs.steer(model, {layer: v}, scale=2.0, positions=3):
        got = _greedy(model, enc)
    hand = _HandSteer(model, layer, v, 3, enc["attention_mask"])
    try:
        ref = _greedy(model, enc)
    finally:
        hand.remove()
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    ids = torch.tensor([[3, 5, 11, 12, 3, 14, 15, 4]])

    def loop():
        with torch.no_grad():
            out = model(ids[:, :4], use_cache=True)
            logits = [out.logits[:, -1]]
            for t in range(4, 8):
                out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
                logits.append(out.logits[:, -1])
        return torch.stack(logits)

    with hs.steer(model, {layer: v}, scale=2.0, positions=3):
        steered = loop()
    cols = iter([torch.arange(4), *(torch.tensor([t]) for t in range(4, 8))])

    def add(m, a, o):
        chosen = next(cols) >= 3  # the columns of this call of the loop
        return o + 2.0 * v * chosen[None, :, None]  # (MiniMax's layers return a tensor)

    h = model.get_submodule(layer).register_forward_hook(add)
    try:
        want = loop()
    finally:
        h.remove()
    torch.testing.assert_close(steered, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache", [True, False])
def test_steer_prompt_leaves_the_left_padding_alone(cache):
    # positions='prompt' steered every slot of the prompt's call, its left padding too: a
    # linear-attention layer (MiniMax's) carries a padding slot's value into the state the
    # decode steps read, so the generated tokens' scores were 5e-3 off a hand hook that steers
    # the prompt's real tokens (positions count real tokens, padding taken out)
    model = tiny_decoder("minimax")
    layer = "model.layers.0"
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    assert (enc["attention_mask"] == 0).any()
    v = _vector(model)
    with hs.steer(model, {layer: v}, scale=2.0, positions="prompt"):
        got = _greedy(model, enc, use_cache=cache)
    hand = _HandSteer(model, layer, v, "prompt", enc["attention_mask"])
    try:
        ref = _greedy(model, enc, use_cache=cache)
    finally:
        hand.remove()
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
