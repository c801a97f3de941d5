"""Language-model generation: token-aligned capture (``sequence=True``), ``steer`` and
``steering_vector``, checked against one full forward over the final sequence and against the
``steering-vectors`` package (random-weight models, a local tokenizer, nothing downloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from _lm import tiny_gpt2, tiny_llama, word_tokenizer

PROMPTS = ["the cat went to the park", "mary gave"]  # 6 and 2 tokens: row 1 is left-padded
ATOL = 1e-5


def _blocks(model) -> list[str]:
    return (
        [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
        if hasattr(model, "transformer")
        else [f"model.layers.{i}" for i in range(len(model.model.layers))]
    )


def _reference(model, layers, sequences, prompt_mask):
    """One full forward over the final sequence (minus the last token, which generate never ran),
    with the mask and position ids generate uses; per row, the real tokens' values in order."""
    ids = sequences[:, :-1]
    mask = torch.cat(
        [prompt_mask, torch.ones(len(ids), ids.shape[1] - prompt_mask.shape[1], dtype=torch.long)],
        1,
    )
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with hs.capture(model, layers) as ref:
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    keep = mask.bool()
    return {n: [ref[n][b][keep[b]] for b in range(len(ids))] for n in layers}, [
        ids[b][keep[b]] for b in range(len(ids))
    ]


def _check_rows(seq, rows, tokens):
    assert seq.mask.sum(1).tolist() == [len(r) for r in rows]
    for b, r in enumerate(rows):
        n = len(r)
        assert seq.mask[b, :n].all() and not seq.mask[b, n:].any()
        torch.testing.assert_close(seq.values[b, :n], r, atol=ATOL, rtol=0)
        assert torch.equal(seq.values[b, n:], torch.zeros_like(seq.values[b, n:]))
        assert seq.tokens[b, :n].tolist() == tokens[b].tolist()
        assert (seq.tokens[b, n:] == -1).all()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize(
    "how",
    [{}, {"cache_implementation": "static"}, {"use_cache": False}, {"do_sample": True}],
    ids=["dynamic", "static", "no-cache", "sampling"],
)
def test_sequence_equals_one_full_forward_over_the_final_sequence(make, how):
    model = make()
    layers = _blocks(model)
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    assert enc["attention_mask"][1].tolist() == [0, 0, 0, 0, 1, 1]
    how = dict(how)
    sample = how.pop("do_sample", False)
    torch.manual_seed(3)
    with hs.capture(model, layers, sequence=True) as cap:
        out = model.generate(**enc, max_new_tokens=5, do_sample=sample, **how)
    rows, tokens = _reference(model, layers, out, enc["attention_mask"])
    for name in layers:
        seq = cap.sequence(name)
        assert seq.values.shape == (2, 10, 64)  # 6 prompt + 4 generated tokens ran; row 1: 2 + 4
        _check_rows(seq, rows[name], tokens)
    # the ragged calls it was built from: the prompt, then one token per call
    assert [c.output.shape[1] for c in cap.calls(layers[0])][:2] == (
        [10 - 4, 7] if how.get("use_cache") is False else [6, 1]
    )


def test_sequence_of_a_hand_written_kv_cache_loop():
    from transformers import DynamicCache

    model = tiny_llama()
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    cache = DynamicCache()
    with hs.capture(model, "model.layers.1", sequence=True) as cap, torch.no_grad():
        step_ids, seq = ids, ids
        for _ in range(4):
            pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            logits = model(
                input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=cache
            ).logits
            step_ids = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, step_ids], 1)
            mask = torch.cat([mask, torch.ones_like(step_ids)], 1)
    rows, tokens = _reference(model, ["model.layers.1"], seq, enc["attention_mask"])
    _check_rows(cap.sequence("model.layers.1"), rows["model.layers.1"], tokens)
    # a mask that does not cover the cached tokens: refused, not guessed
    cache = DynamicCache()
    with hs.capture(model, "model.layers.1", sequence=True) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=enc["attention_mask"], past_key_values=cache)
        model(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 1), past_key_values=cache)
    with pytest.raises(
        hs.SequenceError,
        match="model call 1 .* 1 columns wide for 1 new tokens, but the KV cache held 6",
    ):
        cap.sequence("model.layers.1")


def test_sequence_follows_beam_search_reorders():
    model = tiny_gpt2()
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    with hs.capture(model, "transformer.h.1", sequence=True) as cap:
        out = model.generate(**enc, max_new_tokens=5, num_beams=3, do_sample=False)
    seq = cap.sequence("transformer.h.1")
    assert seq.values.shape[0] == 6  # rows of the last call: 2 prompts x 3 beams
    naive = torch.cat([c.output for c in cap.calls("transformer.h.1")], 1)
    assert not torch.allclose(naive[:3, 6:10], seq.values[:3, 6:10])  # rows really were reordered
    for b in range(6):  # each row is the history of that beam: one forward over its tokens alone
        n = int(seq.mask[b].sum())
        with hs.capture(model, "transformer.h.1") as ref:
            model(input_ids=seq.tokens[b, :n][None])
        torch.testing.assert_close(seq.values[b, :n], ref["transformer.h.1"][0], atol=ATOL, rtol=0)
    assert out.shape == (2, 11)


def test_sequence_errors_name_the_fix():
    model = tiny_gpt2()
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    with hs.capture(model, "transformer.h.0") as cap:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    with pytest.raises(hs.SequenceError, match="sequence=True"):
        cap.sequence("transformer.h.0")
    with hs.capture(model, "transformer.h.0", sequence=True) as cap:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    with pytest.raises(hs.SequenceError, match="2 separate sequences.*cap.clear"):
        cap.sequence("transformer.h.0")
    cap.clear()
    with pytest.raises(hs.SequenceError, match="never called"):
        cap.sequence("transformer.h.0")
    with pytest.raises(ValueError, match="keep='all'"):
        hs.capture(model, "transformer.h.0", sequence=True, keep="last")
    with pytest.raises(hs.LayerNotFoundError):
        cap.sequence("transformer.h.9")


def test_sequence_refuses_a_layer_called_twice_per_model_call():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, input_ids):
            return self.lin(self.lin(self.emb(input_ids)))

    net = Twice()
    with hs.capture(net, "lin", sequence=True) as cap:
        net(torch.tensor([[1, 2, 3]]))
    with pytest.raises(hs.SequenceError, match="'lin' ran 2 times during model call 0"):
        cap.sequence("lin")


class _Toy(nn.Module):
    """Embedding -> block -> (pool, branch): a branch that runs on prompts only, and a pooled
    output without a token axis."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.branch = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.block(self.emb(input_ids))
        if input_ids.shape[1] > 1:
            h = self.branch(h)
        return h.mean(1)


def test_sequence_refuses_what_it_cannot_align():
    net = _Toy()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with hs.capture(net, ["block", "branch", ""], sequence=True) as cap:
        net(ids, attention_mask=torch.ones(2, 3))
        net(ids[:, :1], attention_mask=torch.ones(2, 4))  # one cached step: the branch skips it
    seq = cap.sequence("block")
    torch.testing.assert_close(seq.values[:, :3], net.block(net.emb(ids)))
    torch.testing.assert_close(seq.values[:, 3], net.block(net.emb(ids[:, 0])))
    with pytest.raises(hs.SequenceError, match="'branch' ran 0 times during model call 1"):
        cap.sequence("branch")
    with pytest.raises(hs.SequenceError, match=r"has shape \(2, 4\); sequence\(\) needs"):
        cap.sequence("")
    with hs.capture(net, "block", sequence=True) as cap:
        net(ids, attention_mask=torch.ones(2, 3))
        net(ids[:1, :1], attention_mask=torch.ones(1, 4))  # a row dropped between calls
    with pytest.raises(hs.SequenceError, match="batch changed"):
        cap.sequence("block")


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
    toy = _Toy()  # a steered layer that does not run in a call (as under a compiled forward)
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


@pytest.mark.slow
def test_compiled_model_generating_with_the_static_cache():
    """Capture and steering in one scope (one hooked variant to compile) on ``model.compile()``:
    the same tokens and values as the eager model, which the tests above check against a full
    forward; the hooked variant is compiled once and reused."""
    model = tiny_gpt2(n_layer=2)
    layers = _blocks(model)
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    v = torch.randn(64) * 3
    kw = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    plain = model.generate(**enc, **kw)

    def run():
        with (
            hs.steer(model, {layers[0]: v}, positions="generated"),
            hs.capture(model, layers[1], sequence=True) as cap,
        ):
            out = model.generate(**enc, **kw)
        return out, cap.sequence(layers[1])

    eager_out, eager_seq = run()
    model.compile(backend="eager")
    out, seq = run()
    assert torch.equal(out, eager_out) and not torch.equal(out, plain)
    assert torch.equal(seq.mask, eager_seq.mask) and torch.equal(seq.tokens, eager_seq.tokens)
    torch.testing.assert_close(seq.values, eager_seq.values, atol=ATOL, rtol=0)
    assert hs.hooks_on(model) == []


def test_generate_compiling_the_model_by_itself_still_runs_the_hooks():
    """transformers' generate() compiles the model's __call__ by itself for a static cache (on a
    GPU; on any device with ``_compile_all_devices``), and Dynamo does not guard on hooks: hooks
    added after that compile were silently skipped in every decode step. While a scope is on the
    model, those steps run eagerly, with one warning naming the layers; values equal a full
    forward and the edit acts on every step, as with ``disable_compile=True``."""
    from transformers import CompileConfig

    model = tiny_gpt2(n_layer=1)
    layer = _blocks(model)[0]
    ids = torch.tensor([[5, 9, 12, 7, 30]])
    cc = CompileConfig(backend="eager")
    cc._compile_all_devices = True  # what a GPU gets by default
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    model.generate(ids, compile_config=cc, **kw)  # compiled without hooks, as a user would have
    assert hasattr(model, "_compiled_call")

    warns = pytest.warns(hs.HookscopeWarning, match=f"skip the hooks on layers '{layer}'.*eagerly")
    with warns, hs.capture(model, layer) as cap:
        out = model.generate(ids, compile_config=cc, **kw)
        twin = copy.deepcopy(model)  # a copy holds no hooks: it compiles as transformers does
        assert twin.get_compiled_call(cc) is twin._compiled_call
    calls = cap.calls(layer)
    assert len(calls) == 4  # the prompt, then 3 decode steps (was 1)
    with hs.capture(model, layer) as ref:
        model(out[:, :-1])
    got = torch.cat([c.output for c in calls], 1)
    torch.testing.assert_close(got, ref[layer], atol=ATOL, rtol=0)

    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3

    def shift(t):
        return t + v

    scores = dict(output_scores=True, return_dict_in_generate=True)
    with pytest.warns(hs.HookscopeWarning, match="eagerly"), hs.edit(model, {layer: shift}):
        edited = model.generate(ids, compile_config=cc, **kw, **scores).scores
    with hs.edit(model, {layer: shift}):
        eager = model.generate(ids, disable_compile=True, **kw, **scores).scores
    plain = model.generate(ids, compile_config=cc, **kw, **scores).scores
    for e, r, p in zip(edited, eager, plain, strict=True):  # every step edited, as in eager
        torch.testing.assert_close(e, r, atol=ATOL, rtol=0)
        assert (e - p).abs().max() > 0.1
    assert "get_compiled_call" not in model.__dict__  # the model is left as found
    assert hs.hooks_on(model) == []
