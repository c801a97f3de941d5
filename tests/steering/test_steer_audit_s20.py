"""steer in bf16/fp16 equals its references bit for bit: steering-vectors' ``apply`` (mode="add":
the float32 sum rounded once) and a hand-written float64 projection rounded once (mode="ablate");
before, the vector was rounded to the output's dtype first (bf16 logits 2.4e-3 off
steering-vectors'), and an fp16 direction of norm above 65504 ablated nothing. steering_vector
with ``read`` other than -1, batches that do not divide the pairs, a tokenizer adding BOS or
padding on the left: equal to steering-vectors run one pair at a time (no padding)."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import _tokenizer_dir, tiny_gpt2, tiny_llama, word_tokenizer

LAYER = "model.layers.0"


def _h(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("min_token_index", [None, 2])
def test_bf16_add_equals_steering_vectors_apply(min_token_index):
    from steering_vectors import SteeringVector

    model = tiny_gpt2().to(torch.bfloat16)
    torch.manual_seed(1)
    v = torch.randn(64) * 0.37
    ids = word_tokenizer()(["the cat went to the park"], return_tensors="pt")
    kw = {} if min_token_index is None else {"min_token_index": min_token_index}
    with SteeringVector({0: v}, "decoder_block").apply(model, multiplier=3.0, **kw):
        ref = model(**ids).logits
    positions = "all" if min_token_index is None else min_token_index
    with hs.steer(model, {"transformer.h.0": v}, scale=3.0, positions=positions):
        got = model(**ids).logits
    assert torch.equal(got, ref)


def _hand_ablate(v: torch.Tensor, scale: float, upto: int | None = None):
    u = v.double() / v.double().norm()

    def hook(module, args, out):
        h = _h(out)
        delta = -scale * (h.double() @ u)[..., None] * u
        if upto is not None:
            delta[:, :upto] = 0
        new = (h.double() + delta).to(h.dtype)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return hook


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("scale", "positions"), [(1.0, "all"), (-1.0, "all"), (0.5, 3)])
def test_low_precision_ablate_equals_the_float64_projection_rounded_once(dtype, scale, positions):
    """bf16: was up to 2.4e-4 off (one step), the direction's residual 3.7x the reference's."""
    model = tiny_llama().to(dtype)
    torch.manual_seed(2)
    v = torch.randn(64)
    ids = word_tokenizer()(["the cat went to the park"], return_tensors="pt")
    upto = positions if isinstance(positions, int) else None
    handle = model.get_submodule(LAYER).register_forward_hook(_hand_ablate(v, scale, upto))
    try:
        with hs.capture(model, LAYER) as ref:
            model(**ids)
    finally:
        handle.remove()
    with (
        hs.steer(model, {LAYER: v}, scale=scale, mode="ablate", positions=positions),
        hs.capture(model, LAYER) as got,
    ):
        model(**ids)
    assert torch.equal(_h(got[LAYER]), _h(ref[LAYER]))


def test_fp16_ablate_of_a_direction_with_a_norm_past_fp16s_range_acts():
    """Its fp16 norm was inf, the unit vector 0: the output was left unchanged, silently."""
    model = tiny_llama().to(torch.float16)
    torch.manual_seed(3)
    v = torch.randn(64) * 20000  # norm ~1.6e5 > 65504
    ids = word_tokenizer()(["the cat went"], return_tensors="pt")
    handle = model.get_submodule(LAYER).register_forward_hook(_hand_ablate(v, 1.0))
    try:
        with hs.capture(model, LAYER) as ref:
            model(**ids)
    finally:
        handle.remove()
    with hs.steer(model, {LAYER: v}, mode="ablate"), hs.capture(model, LAYER) as got:
        model(**ids)
    assert torch.equal(_h(got[LAYER]), _h(ref[LAYER]))


def _bos_tokenizer(side: str):
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(_tokenizer_dir())
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", 2)]
    )
    tok.padding_side = side
    return tok


POS = ["i love you", "very happy and good", "great news", "the cat is happy", "yes i like it"]
NEG = ["i hate you", "very sad", "terrible and bad news", "the dog is sad", "no way"]


@pytest.mark.parametrize(
    ("read", "bos", "side"), [(-2, False, "left"), (1, True, "right"), (0, True, "left")]
)
def test_steering_vector_read_equals_steering_vectors_one_pair_at_a_time(read, bos, side):
    """Five pairs in batches of 2 (the last holds one), prompts of 2 to 5 tokens. (steering-
    vectors itself, batched with left padding, is 0.019 off on GPT-2: the padding shifts its
    absolute positions; hookscope pads on the right.)"""
    from steering_vectors import train_steering_vector

    model = tiny_gpt2()
    tok = _bos_tokenizer(side) if bos else word_tokenizer(side)
    assert (tok("i love")["input_ids"][0] == 2) == bos
    ref = train_steering_vector(
        model, tok, list(zip(POS, NEG)), layers=[1], read_token_index=read, batch_size=1
    ).layer_activations[1]
    got = hs.steering_vector(
        model, POS, NEG, "transformer.h.1", read=read, tokenizer=tok, batch_size=2
    )["transformer.h.1"]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
