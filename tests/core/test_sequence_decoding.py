"""``capture(sequence=True)`` under prompt-lookup decoding: one value per token of the returned
sequence, equal to one forward over it (the guide's table claimed it; no test ran it)."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import tiny_decoder, tiny_gpt2, word_tokenizer

# repeats itself, so that prompt-lookup decoding finds candidates in it
PROMPT = "the cat went to the park and the cat went to the park and the cat"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sequence_under_prompt_lookup_decoding_is_the_returned_sequence(kind):
    # The last verification call runs candidates past the tokens generate() returns: they were
    # kept as the sequence's last columns (values and tokens of candidates that are not in the
    # output), so seq.values had more tokens than ran for the output, silently.
    model = tiny_gpt2(n_layer=2) if kind == "gpt2" else tiny_decoder("llama")
    layer = list(hs.blocks(model))[-1]
    enc = word_tokenizer("left")([PROMPT], return_tensors="pt")
    with hs.capture(model, layer, sequence=True) as cap:
        out = model.generate(
            **enc, max_new_tokens=6, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=3
        )
    seq = cap.sequence(layer)
    ids = out[:, :-1]
    assert seq.tokens.tolist() == ids.tolist()
    assert seq.mask.all()
    with hs.capture(model, layer) as ref:
        model(input_ids=ids)
    torch.testing.assert_close(seq.values, ref[layer], atol=1e-5, rtol=0)
