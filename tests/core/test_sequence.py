"""Token-aligned capture of language-model generation (``capture(sequence=True)``), checked
against one full forward over the final sequence (random-weight models, a local tokenizer);
generate() with a compiled model or the static cache."""

from __future__ import annotations

import copy
import inspect
import threading

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.lm import (
    PROMPTS,
    PromptBranchLM,
    lm_blocks,
    tiny_bart,
    tiny_decoder,
    tiny_gpt2,
    tiny_llama,
    tiny_mamba,
    tiny_t5,
    word_tokenizer,
)

ATOL = 1e-5


def _reference(model, layers, sequences, prompt_mask):
    """One full forward over the final sequence (minus the last token, which generate never ran),
    with the mask and position ids generate uses; per row, the real tokens' values in order."""
    ids = sequences[:, :-1]
    mask = torch.cat(
        [prompt_mask, torch.ones(len(ids), ids.shape[1] - prompt_mask.shape[1], dtype=torch.long)],
        1,
    )
    # the position ids generate passes: the prompt's (padding at 0), then one more per token
    prompt_pos = (prompt_mask.cumsum(1) - 1).masked_fill(prompt_mask == 0, 0)
    steps = torch.arange(1, ids.shape[1] - prompt_mask.shape[1] + 1)
    pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + steps], 1)
    kw = (
        {"position_ids": pos}
        if "position_ids" in inspect.signature(model.forward).parameters
        else {}
    )
    with hs.capture(model, layers) as ref:
        model(input_ids=ids, attention_mask=mask, **kw)
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
    layers = lm_blocks(model)
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


def test_sequence_refuses_what_it_cannot_align():
    net = PromptBranchLM()
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


@pytest.mark.slow
def test_compiled_model_generating_with_the_static_cache():
    """Capture and steering in one scope (one hooked variant to compile) on ``model.compile()``:
    the same tokens and values as the eager model, which the tests above check against a full
    forward; the hooked variant is compiled once and reused."""
    model = tiny_gpt2(n_layer=2)
    layers = lm_blocks(model)
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
    layer = lm_blocks(model)[0]
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


# -- every cache kind, several architectures ------------------------------------------------------
ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "mistral", "opt"]


def _generate_and_check(model, layers, side, **how):
    enc = word_tokenizer(side)(PROMPTS, return_tensors="pt", padding=True)
    with hs.capture(model, layers, sequence=True) as cap:
        out = model.generate(**enc, max_new_tokens=5, eos_token_id=None, **how)
    rows, tokens = _reference(model, layers, out, enc["attention_mask"])
    for name in layers:
        _check_rows(cap.sequence(name), rows[name], tokens)
    return cap, out


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sequence_on_each_architecture_and_cache_equals_one_full_forward(kind, cache):
    """Qwen2/Qwen3/Gemma-2 get a dict of 4-D masks with the static cache (the left padding was
    kept, rows misaligned); Mistral's sliding-window static cache hid the first prompt tokens
    from the last query row (captured tokens started at the third); Gemma-2 mixes sliding and
    full layers (a hybrid cache)."""
    model = tiny_decoder(kind)
    how = {"cache_implementation": "static"} if cache == "static" else {}
    cap, _ = _generate_and_check(model, hs.blocks(model), "left", do_sample=False, **how)
    seq = cap.sequence(next(iter(hs.blocks(model))))
    assert seq.mask.sum(1).tolist() == [10, 6]  # 6 and 2 prompt tokens, 4 generated that ran
    assert seq.tokens[1, :2].tolist() == [7, 15]  # "mary gave": the left padding taken out


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sequence_with_right_padding_and_sampling(kind, cache):
    model = tiny_decoder(kind)
    how = {"cache_implementation": "static"} if cache == "static" else {}
    torch.manual_seed(0)
    _generate_and_check(model, list(hs.blocks(model))[-1:], "right", do_sample=True, **how)


@pytest.mark.parametrize("kind", ["gemma2", "mistral", "llama", "mistral-static", "mamba"])
def test_sequence_follows_beam_search_under_a_sliding_window(kind):
    """A sliding-window cache no longer holds the early tokens' keys, so rows cannot be matched
    by their keys: the reorders are read from the cache's reorder_cache (beam_idx); also for a
    static cache and a state-space model's recurrent state."""
    how = {"cache_implementation": "static"} if kind.endswith("-static") else {}
    model = tiny_mamba() if kind == "mamba" else tiny_decoder(kind.removesuffix("-static"))
    layer = list(hs.blocks(model))[-1]
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    with hs.capture(model, layer, sequence=True) as cap:
        model.generate(
            **enc, max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None, **how
        )
    seq = cap.sequence(layer)
    assert seq.values.shape[0] == 6
    naive = torch.cat([c.output for c in cap.calls(layer)], 1)
    assert not torch.allclose(naive[:3, 6:11], seq.values[:3, 6:11])  # really reordered
    for b in range(6):  # each row: one forward over that beam's own tokens
        n = int(seq.mask[b].sum())
        with hs.capture(model, layer) as ref:
            model(input_ids=seq.tokens[b, :n][None])
        torch.testing.assert_close(seq.values[b, :n], ref[layer][0], atol=ATOL, rtol=0)


def test_reorder_cache_is_left_as_found():
    """The cache's reorder_cache is wrapped while a capture or a steer is open on the model
    (both learn each beam_idx), and put back when the last one closes."""
    from transformers import DynamicCache

    model = tiny_decoder("llama")
    cache = DynamicCache()
    ids = torch.tensor([[3, 5, 6], [7, 8, 9]])
    v = torch.zeros(64)
    with hs.capture(model, "model.layers.0", sequence=True) as cap, torch.no_grad():
        with hs.steer(model, {"model.layers.1": v}, positions=0):  # a second tracker on it
            model(input_ids=ids, past_key_values=cache)
        assert "reorder_cache" in vars(cache)  # the capture's tracker still follows it
        cache.reorder_cache(torch.tensor([1, 1]))
        model(input_ids=ids[:, :1], past_key_values=cache)
    assert "reorder_cache" not in vars(cache)
    seq = cap.sequence("model.layers.0")
    assert seq.tokens.tolist() == [[7, 8, 9, 3], [7, 8, 9, 7]]  # both rows continue row 1


def test_sequence_of_a_state_space_model():
    """Mamba passes its cache as cache_params and no mask after the prompt: every decode call
    was taken for a new sequence ("saw 2 separate sequences")."""
    model = tiny_mamba()
    _generate_and_check(model, hs.blocks(model), "left", do_sample=False)


@pytest.mark.parametrize("make", [tiny_t5, tiny_bart], ids=["t5", "bart"])
def test_sequence_of_encoder_decoder_generation(make):
    """The decoder's tokens are the sequence (the encoder runs once, over the source), checked
    against one forward with the final decoder inputs; encoder layers are refused by name."""
    model = make()
    enc = word_tokenizer("right")(PROMPTS, return_tensors="pt", padding=True)
    layers = list(hs.blocks(model))
    dec = [n for n in layers if "decoder" in n]
    assert len(dec) == 2 and len(layers) == 4  # hs.blocks gives both stacks
    with hs.capture(model, layers, sequence=True) as cap:
        out = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=None)
    with hs.capture(model, dec) as ref:
        model(**enc, decoder_input_ids=out[:, :-1])
    for name in dec:
        seq = cap.sequence(name)
        assert seq.mask.all() and seq.tokens.tolist() == out[:, :-1].tolist()
        want = ref[name][0] if isinstance(ref[name], tuple) else ref[name]  # T5: (hidden, ...)
        torch.testing.assert_close(seq.values, want, atol=ATOL, rtol=0)
    with pytest.raises(hs.SequenceError, match="outside the model's calls.*encoder"):
        cap.sequence(layers[0])


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_sequence_with_a_quantized_cache_equals_the_calls_aligned_by_hand(sample):
    """A quantized cache (the fp8 backend, which runs on a CPU) changes the values, so the
    reference is a hand-written hook on the same run, its calls laid side by side and the left
    padding taken out by hand."""
    model = tiny_decoder("qwen2")
    enc = word_tokenizer("left")(PROMPTS, return_tensors="pt", padding=True)
    calls = []
    handle = model.model.layers[1].register_forward_hook(
        lambda m, a, out: calls.append(out.detach().clone())
    )
    torch.manual_seed(0)
    try:
        with hs.capture(model, "model.layers.1", sequence=True) as cap:
            out = model.generate(
                **enc,
                max_new_tokens=5,
                do_sample=sample,
                eos_token_id=None,
                cache_implementation="quantized",
                cache_config={"backend": "fp8"},
            )
    finally:
        handle.remove()
    assert type(cap.calls("model.layers.1")) is list and len(calls) == 5
    full = torch.cat(calls, 1)
    keep = torch.cat([enc["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1).bool()
    seq = cap.sequence("model.layers.1")
    for b in range(2):
        n = int(keep[b].sum())
        assert torch.equal(seq.values[b, :n], full[b][keep[b]])
        assert seq.tokens[b, :n].tolist() == out[b, :-1][keep[b]].tolist()


def test_sequence_error_for_a_generate_in_another_thread_names_the_thread():
    """capture(sequence=True) around generate() run in a background thread records nothing (a
    scope acts only on its own thread's calls): sequence() says so, naming the thread and the fix,
    rather than that the model was never called with token inputs."""
    model = tiny_gpt2().eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with hs.capture(model, ["transformer.h.0"], sequence=True) as cap:
        worker = threading.Thread(target=model.generate, kwargs=kwargs, name="generator")
        worker.start()
        worker.join()
    with pytest.raises(
        hs.SequenceError,
        match=r"sequence\('transformer.h.0'\): the model was called only from another thread "
        r"\('generator'\).*acts only on the calls of the thread that created it.*open the "
        r"capture inside the function the thread runs",
    ):
        cap.sequence("transformer.h.0")


def test_sequence_error_for_a_layer_the_model_runs_in_a_thread_of_its_own_names_the_rule():
    """A layer that the model's forward runs in a thread it starts is not recorded; the error for
    the call it missed names the thread rule besides a compiled forward."""

    class Threaded(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, input_ids):
            out = []
            worker = threading.Thread(target=lambda: out.append(self.lin(self.emb(input_ids))))
            worker.start()
            worker.join()
            return out[0]

    net = Threaded()
    with hs.capture(net, "lin", sequence=True) as cap:
        net(torch.tensor([[1, 2, 3]]))
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"'lin' ran in thread .*, which the model's forward started and waited on.*acts "
        r"only on the calls of the thread that opened it",
    ):
        cap.sequence("lin")


def test_sequence_error_for_calls_without_tokens_here_and_calls_in_another_thread_says_both():
    """The scope's thread called the model without token inputs (a 1-D tensor) and another thread
    called it with tokens: the error names both facts."""
    net = nn.Embedding(10, 4)
    with hs.capture(net, "", sequence=True) as cap:
        net(torch.tensor([1, 2]))
        worker = threading.Thread(target=net, args=(torch.tensor([[1, 2]]),), name="other")
        worker.start()
        worker.join()
    assert len(cap.calls("")) == 1  # the scope's own call only
    with pytest.raises(
        hs.SequenceError,
        match=r"never called with token inputs \(input_ids or inputs_embeds\) while the capture "
        r"was open; its calls from thread 'other' were left alone: a scope acts only on the calls "
        r"of the thread that created it",
    ):
        cap.sequence("")
