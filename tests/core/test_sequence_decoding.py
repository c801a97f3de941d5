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


def test_a_language_model_pickles_while_scopes_are_open():
    # torch.save(model) raised "cannot pickle 'weakref.ReferenceType' object" while any scope was
    # on a transformers model (its get_compiled_call is replaced while hooks are on it; docs/
    # pitfalls.md §23 says a model with hookscope attached saves). The copy generates as the model.
    import io

    model = tiny_gpt2(n_layer=2)
    ids = torch.tensor([[3, 4, 5]])
    buf = io.BytesIO()
    with (
        hs.steer(model, {"transformer.h.0": torch.zeros(64)}),
        hs.capture(model, "transformer.h.1", sequence=True),
    ):
        torch.save(model, buf)
        model(ids)  # (a steer whose layer never ran warns)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    kw = dict(max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert torch.equal(twin.generate(ids, **kw), model.generate(ids, **kw))
    with hs.capture(twin, "transformer.h.1", sequence=True) as cap:
        out = twin.generate(ids, **kw)
    assert cap.sequence("transformer.h.1").tokens.tolist() == out[:, :-1].tolist()
