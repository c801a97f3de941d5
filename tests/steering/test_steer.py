"""Steering: ``steer`` (forwards and ``generate``) and ``steering_vector``, checked against a
hand-written hook over the final sequence and against the ``steering-vectors`` package."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import (
    PROMPTS,
    PromptBranchLM,
    final_forward_inputs,
    tiny_decoder,
    tiny_gpt2,
    tiny_llama,
    tiny_mamba,
    tiny_t5,
    word_tokenizer,
)

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


def _assert_equals_a_hand_hook(model, layer, read, seq, add_at, ids, amask, **kw):
    """The steered generation's ``seq`` at ``read`` equals one forward over ``ids`` with a hand
    hook adding ``add_at(output)`` at ``layer``, token for token over the real tokens."""
    handle = _hand_steer(model, layer, add_at)
    try:
        with hs.capture(model, read) as ref:
            model(input_ids=ids, attention_mask=amask, **kw)
    finally:
        handle.remove()
    keep = amask.bool()
    for b in range(len(keep)):
        n = int(keep[b].sum())
        torch.testing.assert_close(seq.values[b, :n], ref[read][b][keep[b]], atol=ATOL, rtol=0)


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
    add_at = lambda out: 0.5 * v * chosen[..., None]  # noqa: E731
    _assert_equals_a_hand_hook(model, layer, read, seq, add_at, ids, amask, position_ids=pos)
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


# -- every cache kind, several architectures ------------------------------------------------------
def _chosen(positions, prompt_mask, total):
    """Which columns of the final sequence ``positions`` selects (what each call steered)."""
    n_new = total - prompt_mask.shape[1]
    amask = torch.cat([prompt_mask, torch.ones(len(prompt_mask), n_new, dtype=torch.long)], 1)
    pos = amask.cumsum(1) - 1
    col = torch.arange(total).expand(len(amask), -1)
    gen = col >= prompt_mask.shape[1]
    real = amask.bool()
    if positions == "generated":
        return gen
    if positions >= 0:
        return (pos >= positions) & real
    # -k: the last k tokens of each call: the prompt's last k, then every generated token
    last = prompt_mask.sum(1, keepdim=True) + positions
    return gen | ((pos >= last) & real)


def _steered_against_a_hand_hook(model, layer, read, enc, positions, **how):
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    with (
        hs.steer(model, {layer: v}, scale=0.5, positions=positions),
        hs.capture(model, read, sequence=True) as cap,
    ):
        out = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=None, **how)
    seq = cap.sequence(read)
    kw = final_forward_inputs(model, out, enc["attention_mask"])
    ids, amask = kw.pop("input_ids"), kw.pop("attention_mask")
    chosen = _chosen(positions, enc["attention_mask"], ids.shape[1])
    assert 0 < chosen.sum() < chosen.numel()
    add_at = lambda out: 0.5 * v * chosen[..., None]  # noqa: E731
    _assert_equals_a_hand_hook(model, layer, read, seq, add_at, ids, amask, **kw)
    plain = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=None, **how)
    return out, plain


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("positions", [3, -2, "generated"])
def test_steer_positions_on_each_cache_equal_a_hand_hook(kind, cache, positions):
    """With a static cache, positions were counted with the padding (a dict or sliding-window
    4-D mask was not read): other prompt tokens were steered on Qwen3 and Mistral."""
    model = tiny_decoder(kind)
    how = {"cache_implementation": "static"} if cache == "static" else {}
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    _steered_against_a_hand_hook(model, "model.layers.0", "model.layers.1", enc, positions, **how)


@pytest.mark.parametrize("positions", [3, "generated"])
def test_steer_positions_in_a_state_space_model(positions):
    """Mamba's decode calls were each taken for a new sequence: positions=3 never steered a
    generated token, and 'generated' warned that the model only ran on prompts."""
    model = tiny_mamba()
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    out, plain = _steered_against_a_hand_hook(
        model, "backbone.layers.0", "backbone.layers.1", enc, positions
    )
    assert not torch.equal(out, plain)


@pytest.mark.parametrize("positions", [2, "generated"])
def test_steer_positions_on_the_decoder_of_an_encoder_decoder_model(positions):
    model = tiny_t5()
    enc = word_tokenizer("right")(PROMPTS, return_tensors="pt", padding=True)
    layer, read = "decoder.block.0", "decoder.block.1"
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    with (
        hs.steer(model, {layer: v}, scale=0.5, positions=positions),
        hs.capture(model, read, sequence=True) as cap,
    ):
        out = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=None)
    dec = out[:, :-1]
    col = torch.arange(dec.shape[1]).expand(2, -1)
    chosen = col >= (1 if positions == "generated" else positions)

    def hand(m, a, o):
        return (o[0] + 0.5 * v * chosen[..., None], *o[1:])

    handle = model.get_submodule(layer).register_forward_hook(hand)
    try:
        with hs.capture(model, read) as ref:
            model(**enc, decoder_input_ids=dec)
    finally:
        handle.remove()
    torch.testing.assert_close(cap.sequence(read).values, ref[read][0], atol=ATOL, rtol=0)
    with (  # an encoder layer runs outside the decoder calls: positions cannot count its tokens
        pytest.raises(hs.HookscopeError, match="encoder.*positions='all'"),
        hs.steer(model, {"encoder.block.0": v}, positions=positions),
    ):
        model.generate(**enc, max_new_tokens=2, do_sample=False)


def test_steer_negative_positions_are_the_last_tokens():
    """positions=-1 steered every position; now -k is each row's last k real tokens."""
    model = tiny_gpt2()
    layer = "transformer.h.0"
    ids = torch.tensor([[0, 0, 5, 11, 12], [3, 5, 11, 12, 3]])
    mask = (ids != 0).long()
    with hs.capture(model, layer) as plain:
        model(input_ids=ids, attention_mask=mask)
    v = torch.randn(64)
    for k in (1, 2):
        with hs.steer(model, {layer: v}, positions=-k), hs.capture(model, layer) as cap:
            model(input_ids=ids, attention_mask=mask)
        delta = cap[layer] - plain[layer]
        steered = delta.abs().amax(-1) > 1e-6
        assert steered[:, :-k].sum() == 0 and steered[:, -k:].all()
        torch.testing.assert_close(delta[:, -k:], v.expand(2, k, 64), atol=ATOL, rtol=0)


def test_steer_refuses_non_finite_or_mistyped_inputs():
    model = tiny_gpt2()
    layer = "transformer.h.0"
    v = torch.ones(64)
    nan = v.clone()
    nan[5] = float("nan")
    with pytest.raises(hs.HookscopeError, match="1 non-finite values.*index 5"):
        hs.steer(model, {layer: nan})
    with pytest.raises(ValueError, match="scale must be finite, got inf"):
        hs.steer(model, {layer: v}, scale=float("inf"))
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        hs.steer(model, {layer: v}, scale=float("nan"))
    with pytest.raises(TypeError, match=r"scale must be a number, got str '2'; pass scale=2.0"):
        hs.steer(model, {layer: v}, scale="2")
    with pytest.raises(hs.HookscopeError, match=r"torch.int64; give a floating tensor"):
        hs.steer(model, {layer: torch.ones(64, dtype=torch.long)})
    with pytest.raises(TypeError, match="positions must be .*-k: the last k tokens"):
        hs.steer(model, {layer: v}, positions=1.5)
    with pytest.raises(hs.HookscopeError, match="direction for 'transformer.h.0' is zero"):
        hs.steer(model, {layer: torch.zeros(64)}, mode="ablate")
    assert hs.hooks_on(model) == []


def test_steer_a_layer_returning_a_namedtuple():
    from collections import namedtuple

    Out = namedtuple("Out", ["hidden", "extra"])

    class Block(torch.nn.Module):
        def forward(self, x):
            return Out(x * 2, x.sum())

    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), Block())
    ids = torch.tensor([[1, 2, 3]])
    v = torch.tensor([1.0, 0.0, 0.0, 0.0])
    plain = net[1](net[0](ids))
    with hs.steer(net, {"1": v}, positions=-1):
        out = net(ids)
    assert isinstance(out, Out) and torch.equal(out.extra, plain.extra)
    torch.testing.assert_close(out.hidden[0, :2], plain.hidden[0, :2])
    torch.testing.assert_close(out.hidden[0, 2], plain.hidden[0, 2] + v)


def test_steering_vector_checks_what_the_run_does():
    model = tiny_gpt2().train()  # GPT-2's dropout: another vector per call
    with pytest.raises(hs.HookscopeError, match=r"draws random numbers in the forward of "
                       r"'transformer.drop' \(Dropout\).*model.eval\(\)"):  # fmt: skip
        hs.steering_vector(model, [[3, 4]], [[3, 5]], "transformer.h.1")
    model.eval()
    with pytest.raises(hs.HookscopeError, match=r"positive\[0\] holds torch.float32.*integer ids"):
        hs.steering_vector(model, [[1.7, 2.2]], [[1.0, 2.0]], "transformer.h.0")
    with pytest.raises(
        hs.LayerNotRunError, match=r"layer\(s\) 'branch' did not run in the forward"
    ):
        hs.steering_vector(PromptBranchLM(), [[1]], [[2]], "branch")
    meta = tiny_gpt2().to("meta")
    with pytest.raises(hs.HookscopeError, match="meta device"):
        hs.steering_vector(meta, [[3, 4]], [[3, 5]], "transformer.h.1")


def test_steering_vector_on_an_encoder_decoder_model():
    model = tiny_t5()
    with pytest.raises(hs.HookscopeError, match="'decoder.block.0' is in the decoder"):
        hs.steering_vector(model, [[3, 4]], [[3, 5]], "decoder.block.0")
    got = hs.steering_vector(model, [[3, 4, 5], [6]], [[3, 5], [7, 8]], "encoder.block.1")
    diffs = []
    for p, n in (([3, 4, 5], [3, 5]), ([6], [7, 8])):
        acts = []
        for ids in (p, n):
            with hs.capture(model, "encoder.block.1") as cap:
                model.get_encoder()(input_ids=torch.tensor([ids]))
            acts.append(cap["encoder.block.1"][0][0, -1])
        diffs.append(acts[0] - acts[1])
    torch.testing.assert_close(
        got["encoder.block.1"], torch.stack(diffs).mean(0), atol=ATOL, rtol=0
    )


def test_a_module_steered_twice_warns_naming_it_and_both_changes_apply():
    """A glob matching a block and its submodule (``"*"``), or a module selected by two keys,
    steered it twice, silently: checked against the plain computation by hand (each change is
    applied), and said in a warning naming the modules; each module selected once says
    nothing."""
    import warnings

    import torch.nn as nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    x, v = torch.randn(2, 3, 4), torch.ones(4)
    with torch.no_grad():
        inner = net[0][0](x) + v
        twice_nested = net[1](inner + v) + v  # '0.0', then '0' (its output), then '1'
    with pytest.warns(hs.HookscopeWarning, match=r"'0\.0' inside '0'"), hs.steer(net, {"*": v}):
        got = net(x)
    torch.testing.assert_close(got, twice_nested, rtol=0, atol=0)
    with (
        pytest.warns(hs.HookscopeWarning, match=r"selected by two keys: '1'"),
        hs.steer(net, {"1": v, nn.Linear: v}),
    ):
        got = net(x)
    # nn.Linear also selects '0.0': steered once there, '1' twice
    with torch.no_grad():
        ref = net[1](net[0][0](x) + v) + v + v
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.steer(net, {"0.0": v, "1": v}):
            net(x)
