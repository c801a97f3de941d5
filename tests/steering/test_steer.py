"""Steering: ``steer`` (forwards and ``generate``) and ``steering_vector``, checked against a
hand-written hook over the final sequence and against the ``steering-vectors`` package."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import PROMPTS, PromptBranchLM, tiny_gpt2, tiny_llama, word_tokenizer

ATOL = 1e-5

# -- steering vectors -----------------------------------------------------------------------------
PAIRS = [
    ("i love the cat", "i hate the cat"),
    ("she is happy", "she is very sad"),
    ("good dog", "bad dog and the cat"),
    ("we like you", "we hate you"),
    ("the park is great", "the park is terrible"),
]


def test_steering_vector_equals_steering_vectors_and_a_hand_computation():
    from steering_vectors import train_steering_vector

    model = tiny_gpt2(n_layer=3)
    tok = word_tokenizer("right")
    theirs = train_steering_vector(
        model, tok, PAIRS, layers=[0, 2], read_token_index=-1, batch_size=2
    )
    layers = ["transformer.h.0", "transformer.h.2"]
    ours = hs.steering_vector(
        model, [p for p, _ in PAIRS], [n for _, n in PAIRS], layers, tokenizer=tok, batch_size=2
    )
    assert list(ours) == layers
    for i, name in zip((0, 2), layers):
        torch.testing.assert_close(ours[name], theirs.layer_activations[i], atol=ATOL, rtol=0)
    # by hand: each prompt alone (no padding), read at token 1 and at the last token; the output
    # of block 1 is hidden_states[2] (the last entry of hidden_states has the final norm applied)
    for read in (1, -1):
        got = hs.steering_vector(
            model,
            [p for p, _ in PAIRS],
            [n for _, n in PAIRS],
            "transformer.h.1",
            tokenizer=tok,
            read=read,
            batch_size=3,
        )["transformer.h.1"]
        diffs = []
        for p, n in PAIRS:
            acts = []
            for text in (p, n):
                ids = torch.tensor([tok(text)["input_ids"]])
                with torch.no_grad():
                    hidden = model(ids, output_hidden_states=True).hidden_states[2]
                acts.append(hidden[0, read])
            diffs.append(acts[0] - acts[1])
        torch.testing.assert_close(got, torch.stack(diffs).mean(0), atol=ATOL, rtol=0)


def test_steering_vector_runs_one_forward_per_batch_of_pairs_stopped_after_the_layer():
    model = tiny_gpt2(n_layer=3)
    calls = {"model": 0, "h.2": 0, "rows": []}

    def on_model(m, args, kwargs):
        calls["model"] += 1
        calls["rows"].append(kwargs["input_ids"].shape[0])

    handles = [
        model.register_forward_pre_hook(on_model, with_kwargs=True),
        model.transformer.h[2].register_forward_pre_hook(lambda m, a: calls.__setitem__("h.2", 1)),
    ]
    try:
        pos = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12], [13]]
        neg = [[5, 4], [6, 6], [8], [9], [14, 15]]
        hs.steering_vector(model, pos, neg, "transformer.h.1", batch_size=2)
    finally:
        for h in handles:
            h.remove()
    assert calls == {"model": 3, "h.2": 0, "rows": [4, 4, 2]}


def test_steering_vector_errors():
    model = tiny_gpt2()
    with pytest.raises(hs.HookscopeError, match="3 positive and 2 negative"):
        hs.steering_vector(model, [[3]] * 3, [[4]] * 2, "transformer.h.0")
    with pytest.raises(hs.HookscopeError, match="pass tokenizer="):
        hs.steering_vector(model, ["the cat"], ["a dog"], "transformer.h.0")
    with pytest.raises(
        hs.HookscopeError, match=r"read=5 is outside negative\[1\], which has 2 tokens"
    ):
        hs.steering_vector(model, [[3] * 6, [3] * 6], [[4] * 6, [4, 5]], "transformer.h.0", read=5)
    with pytest.raises(hs.LayerNotFoundError, match="transformer.h.1"):
        hs.steering_vector(model, [[3]], [[4]], "transformer.h.7")


# -- steering -------------------------------------------------------------------------------------
def _hand_steer(model, layer, add_at):
    """A hand-written hook adding ``add_at(output) -> delta`` to a layer's output (the reference)."""
    module = model.get_submodule(layer)
    return module.register_forward_hook(lambda m, a, out: out + add_at(out))


@pytest.mark.parametrize("k", [0, 2])
def test_steer_in_generate_equals_steering_vectors_apply(k):
    from steering_vectors import train_steering_vector

    model = tiny_gpt2(n_layer=3)
    tok = word_tokenizer("right")
    sv = train_steering_vector(model, tok, PAIRS, layers=[0, 2], read_token_index=-1)
    vectors = {f"transformer.h.{i}": v for i, v in sv.layer_activations.items()}
    prompt = tok(["the cat went to"], return_tensors="pt")
    runs = {}
    # steering-vectors counts min_token_index per call: under the KV cache a generated token is
    # call position 0, so k > 0 steers none of them; without the cache every call holds the whole
    # sequence, which is what hs.steer's positions=k means with or without the cache
    for label, ctx, cache in (
        ("theirs", lambda: sv.apply(model, multiplier=4.0, min_token_index=k), k == 0),
        ("ours", lambda: hs.steer(model, vectors, scale=4.0, positions=k), True),
        ("ours-nocache", lambda: hs.steer(model, vectors, scale=4.0, positions=k), False),
    ):
        with hs.capture(model, "transformer.h.1", sequence=True) as cap, ctx():
            torch.manual_seed(1)
            out = model.generate(**prompt, max_new_tokens=8, do_sample=True, use_cache=cache)
        runs[label] = (out, cap.sequence("transformer.h.1").values)
    torch.manual_seed(1)
    plain = model.generate(**prompt, max_new_tokens=8, do_sample=True)
    assert not torch.equal(plain, runs["ours"][0])  # the steering changes the generation
    for label in ("theirs", "ours-nocache"):
        assert torch.equal(runs[label][0], runs["ours"][0])
        torch.testing.assert_close(runs[label][1], runs["ours"][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("positions", ["prompt", "generated", 3, "mask"])
def test_steer_positions_equal_a_hand_hook_over_the_final_sequence(positions):
    model = tiny_llama()
    layer, read = "model.layers.0", "model.layers.1"
    v = torch.randn(64) * 3
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    mask_sel = torch.zeros(2, 12, dtype=torch.bool)
    mask_sel[0, [1, 7]] = True
    mask_sel[1, [0, 4, 5]] = True
    arg = mask_sel if positions == "mask" else positions
    with (
        hs.steer(model, {layer: v}, scale=0.5, positions=arg),
        hs.capture(model, read, sequence=True) as cap,
    ):
        out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    seq = cap.sequence(read)
    # reference: one forward over the final sequence, a hand hook adding at the chosen tokens
    ids = out[:, :-1]
    amask = torch.cat([enc["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)
    pos = (amask.cumsum(1) - 1).clamp(min=0)
    col = torch.arange(ids.shape[1]).expand(2, -1)
    chosen = {
        "prompt": col < 6,
        "generated": col >= 6,
        3: (pos >= 3) & amask.bool(),
        "mask": mask_sel.gather(1, pos) & amask.bool(),
    }[positions]
    assert 0 < chosen.sum() < chosen.numel()
    handle = _hand_steer(model, layer, lambda out: 0.5 * v * chosen[..., None])
    try:
        with hs.capture(model, read) as ref:
            model(input_ids=ids, attention_mask=amask, position_ids=pos)
    finally:
        handle.remove()
    keep = amask.bool()
    for b in range(2):
        n = int(keep[b].sum())
        torch.testing.assert_close(seq.values[b, :n], ref[read][b][keep[b]], atol=ATOL, rtol=0)
    assert seq.tokens[0, :10].tolist() == ids[0].tolist()  # the steered generation was checked


def test_steer_ablate_projects_the_direction_out_of_a_plain_forward():
    model = tiny_gpt2()
    layer = "transformer.h.0"
    ids = torch.tensor([[3, 5, 11, 12, 3, 14]])
    with hs.capture(model, layer) as plain:
        model(ids)
    h = plain[layer]
    u = torch.randn(64)
    with hs.steer(model, {layer: u}, mode="ablate"), hs.capture(model, layer) as cap:
        model(ids)
    unit = u / u.norm()
    torch.testing.assert_close(cap[layer], h - (h @ unit)[..., None] * unit, atol=ATOL, rtol=0)
    assert (cap[layer] @ unit).abs().max() < 1e-5 < (h @ unit).abs().max()
    with (
        hs.steer(model, {layer: u}, mode="ablate", scale=0.5, positions=4),
        hs.capture(model, layer) as half,
    ):
        model(ids)
    torch.testing.assert_close(half[layer][0, :4], h[0, :4], atol=0, rtol=0)
    torch.testing.assert_close(
        half[layer][0, 4:], h[0, 4:] - 0.5 * (h[0, 4:] @ unit)[..., None] * unit, atol=ATOL, rtol=0
    )


def test_steer_is_never_silent():
    model = tiny_gpt2()
    ids = torch.tensor([[3, 5, 11]])
    with (
        pytest.warns(hs.HookscopeWarning, match="no position was steered.*only ran on prompts"),
        hs.steer(model, {"transformer.h.0": torch.ones(64)}, positions="generated"),
    ):
        model(ids)
    with (
        pytest.raises(hs.HookscopeError, match=r"'transformer.h.0' has shape \(3,\).*\(64,\)"),
        hs.steer(model, {"transformer.h.0": torch.ones(3)}),
    ):
        model(ids)
    rows3 = torch.ones(3, 4, dtype=torch.bool)
    with (
        pytest.raises(hs.HookscopeError, match="mask has 3 rows but the model was called on 1"),
        hs.steer(model, {"transformer.h.0": torch.ones(64)}, positions=rows3),
    ):
        model(ids)
    toy = (
        PromptBranchLM()
    )  # a steered layer that does not run in a call (as under a compiled forward)
    with (
        pytest.warns(
            hs.HookscopeWarning, match="'branch' did not run during model call 1.*disable_compile"
        ),
        hs.steer(toy, {"branch": torch.ones(4)}),
    ):
        toy(torch.tensor([[1, 2, 3]]))
        toy(torch.tensor([[4]]))
    with pytest.raises(ValueError, match="'all', 'prompt', 'generated'"):
        hs.steer(model, {"transformer.h.0": torch.ones(64)}, positions="last")
    with pytest.raises(hs.LayerNotFoundError):
        hs.steer(model, {"transformer.h.9": torch.ones(64)})
    assert hs.hooks_on(model) == []
