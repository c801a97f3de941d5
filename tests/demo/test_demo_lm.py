"""The shipped demo language model: it continues repeated spans with induction heads, the patching
sweeps find those heads as an attention-pattern score does, and training is reproducible."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import hookscope as hs
from helpers.common import one_thread
from hookscope.demo import train_demo_lm

pytest.importorskip("transformers")

N_HEADS = 4


@pytest.fixture(scope="module")
def lm():
    return hs.load_demo_lm()


@pytest.fixture(scope="module")
def prompts():
    return hs.make_induction_prompts(12, 10, seed=3)


def next_token_logit(prompts):
    """The logit of the correct next token over the repeated half, averaged."""

    def metric(out):
        logits = out.logits[:, prompts.positions]
        return logits.gather(-1, prompts.targets[..., None]).mean()

    return metric


def attention_scores(model, tokens, length):
    """Per layer and head, by hand from the attention probabilities: the induction score
    (attention from each repeated token to the token after its earlier occurrence) and the
    previous-token score (attention from each token to the one before it).

    It runs on a copy: Transformers leaves the hooks that record the attentions on the modules."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        att = twin(tokens, output_attentions=True).attentions  # per layer (B, H, T, T)
    del twin
    gc.collect()
    q = torch.arange(length + 1, 2 * length + 1)
    t = torch.arange(1, tokens.shape[1])
    induction = torch.stack([a[:, :, q, q - length + 1].mean((0, 2)) for a in att])
    previous = torch.stack([a[:, :, t, t - 1].mean((0, 2)) for a in att])
    return induction, previous


def top(values: torch.Tensor, k: int) -> set[tuple[int, int]]:
    idx = values.flatten().topk(k).indices
    return {(int(i) // values.shape[1], int(i) % values.shape[1]) for i in idx}


def test_shipped_lm_continues_repeated_spans_and_not_corrupted_ones(lm, prompts):
    with torch.no_grad():
        clean = lm(prompts.clean).logits[:, prompts.positions].argmax(-1)
        corrupt = lm(prompts.corrupted).logits[:, prompts.positions].argmax(-1)
    assert (clean == prompts.targets).float().mean() > 0.97
    assert (corrupt == prompts.targets).float().mean() < 0.1


def test_head_sweep_and_attribution_rank_the_induction_heads_first(lm, prompts):
    induction, _ = attention_scores(lm, prompts.clean, prompts.length)
    named = {(layer, h) for layer, h in (induction > 0.5).nonzero().tolist()}
    assert named and all(layer == 1 for layer, _ in named)  # layer 1 reads layer 0's output
    metric = next_token_logit(prompts)
    attn = list(hs.blocks(lm, "self_attn"))
    swept = hs.patch_sweep(lm, prompts.clean, prompts.corrupted, metric, attn, over=("head",))
    assert swept.shape == (2, N_HEADS)
    assert top(swept, len(named)) == named
    with torch.no_grad():
        base = float(metric(lm(prompts.corrupted)))
        full = float(metric(lm(prompts.clean)))
    # every other head restores less than a tenth of the clean logit's lead
    others = [float(swept[i, j]) for i in range(2) for j in range(N_HEADS) if (i, j) not in named]
    assert max(others) - base < 0.1 * (full - base)
    scores = hs.attribution_patch(
        lm, prompts.clean, prompts.corrupted, metric, attn, over=("head",)
    )
    assert top(scores, len(named)) == named
    # the strongest head's sweep value against a hand-written hook that patches only its slice
    layer, head = max(named, key=lambda s: float(swept[s]))
    o_proj = lm.model.layers[layer].self_attn.o_proj
    d = o_proj.in_features // N_HEADS
    sl = slice(head * d, (head + 1) * d)
    kept = {}
    h = o_proj.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0].clone()))
    with torch.no_grad():
        lm(prompts.clean)
    h.remove()

    def put(m, a):
        x = a[0].clone()
        x[..., sl] = kept["x"][..., sl]
        return (x,)

    h = o_proj.register_forward_pre_hook(put)
    try:
        with torch.no_grad():
            by_hand = float(metric(lm(prompts.corrupted)))
    finally:
        h.remove()
    assert by_hand == pytest.approx(float(swept[layer, head]), abs=1e-4)


def test_noising_the_previous_token_head_breaks_the_induction(lm, prompts):
    """Patching a layer-0 head's corrupted output into the clean run (``reverse=True``) hurts
    most for the head that the attention pattern names as the previous-token head."""
    _, previous = attention_scores(lm, prompts.clean, prompts.length)
    prev_head = int(previous[0].argmax())
    assert float(previous[0, prev_head]) > 0.5
    metric = next_token_logit(prompts)
    attn = list(hs.blocks(lm, "self_attn"))
    noised = hs.patch_sweep(
        lm, prompts.clean, prompts.corrupted, metric, attn[:1], over=("head",), reverse=True
    )
    assert int(noised[0].argmin()) == prev_head


def test_training_with_the_same_seed_gives_the_same_weights():
    with one_thread():
        a = train_demo_lm(steps=3, seed=5, log=None).state_dict()
        b = train_demo_lm(steps=3, seed=5, log=None).state_dict()
        c = train_demo_lm(steps=3, seed=6, log=None).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    train_demo_lm(steps=1, log=None)
    assert torch.equal(torch.rand(3), expected)


def test_prompts_are_reproducible_and_checked():
    a, b = hs.make_induction_prompts(3, 7, seed=9), hs.make_induction_prompts(3, 7, seed=9)
    assert torch.equal(a.clean, b.clean) and torch.equal(a.corrupted, b.corrupted)
    assert not torch.equal(a.clean, hs.make_induction_prompts(3, 7, seed=10).clean)
    span = a.clean[:, 1:8]
    assert all(len(set(r.tolist())) == 7 for r in span)  # distinct tokens: one right answer
    assert torch.equal(a.targets, a.clean[:, 9:]) and a.clean[0, a.positions].numel() == 6
    with pytest.raises(ValueError, match=r"length must be an int in 2\.\.23"):
        hs.make_induction_prompts(2, 24)
    with pytest.raises(ValueError, match="n must be"):
        hs.make_induction_prompts(0)


def test_a_missing_weights_file_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m hookscope\.demo\._lm train"):
        hs.load_demo_lm(tmp_path / "none.pt")


@pytest.mark.slow
def test_the_default_training_forms_induction_heads():
    with one_thread():  # as `python -m hookscope.demo._lm train` (two threads: 10x slower here)
        model = train_demo_lm(log=None)
    p = hs.make_induction_prompts(64, 12, seed=11)
    with torch.no_grad():
        pred = model(p.clean).logits[:, p.positions].argmax(-1)
    assert (pred == p.targets).float().mean() > 0.95
    induction, _ = attention_scores(model, p.clean, p.length)
    assert float(induction[1].max()) > 0.5
