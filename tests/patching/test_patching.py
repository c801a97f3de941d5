"""Activation patching: sweeps equal TransformerLens's helpers on the same weights and
hand-written hooks on Llama (GQA), GPT-NeoX and BERT; attribution scores equal
``torch.autograd.grad`` by hand; batched equals serial; padding, compiled models, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.lm import tiny_bert, tiny_gpt2, tiny_llama, tiny_neox, tl_bridge, word_tokenizer
from helpers.patch_refs import by_head, by_pos_head, by_position, hand_sweep, hidden_of
from hookscope.patching._heads import head_split

CLEAN = torch.tensor(
    [
        [3, 7, 20, 8, 11, 12, 3, 13, 8, 15, 3, 16, 12],
        [3, 9, 20, 10, 11, 12, 3, 14, 10, 15, 3, 17, 12],
    ]
)
CORRUPT = torch.tensor(
    [
        [3, 7, 20, 8, 11, 12, 3, 13, 7, 15, 3, 16, 12],
        [3, 9, 20, 10, 11, 12, 3, 14, 9, 15, 3, 17, 12],
    ]
)
MARY, JOHN = 7, 8


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def logit_diff(out):
    lg = logits_of(out)[:, -1]
    return (lg[:, MARY] - lg[:, JOHN]).mean()


# -- TransformerLens on the same weights ------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_and_tl():
    model = tiny_gpt2(n_layer=2)
    bridge = tl_bridge(model, word_tokenizer())
    _, cache = bridge.run_with_cache(CLEAN)
    return model, bridge, cache


HELPERS = {
    "get_act_patch_resid_pre": (None, "input", ("position",)),
    "get_act_patch_attn_out": ("attn", "output", ("position",)),
    "get_act_patch_mlp_out": ("mlp", "output", ("position",)),
    "get_act_patch_attn_head_out_by_pos": ("attn", "output", ("position", "head")),
    "get_act_patch_attn_head_out_all_pos": ("attn", "output", ("head",)),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("helper", list(HELPERS))
def test_sweep_equals_transformer_lens(gpt2_and_tl, helper):
    import transformer_lens.patching as tlp

    model, bridge, cache = gpt2_and_tl
    child, at, over = HELPERS[helper]
    ref = getattr(tlp, helper)(bridge, CORRUPT, cache, logit_diff)
    got = hs.patch_sweep(
        model, CLEAN, CORRUPT, logit_diff, hs.blocks(model, child), at=at, over=over
    )
    assert got.shape == ref.shape
    assert ref.abs().max() > 1e-3 and (ref != ref.flatten()[0]).any()  # a sweep that says something
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_batched_equals_serial_and_fans_out_from_the_block():
    model = tiny_gpt2(n_layer=3)
    attn = "transformer.h.2.attn"
    kw = dict(over=("position", "head"))
    serial = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, rows=2, **kw)
    few = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, rows=10, **kw)
    one = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, **kw)
    assert torch.allclose(few, serial, atol=1e-6) and torch.allclose(one, serial, atol=1e-6)
    # a budget in bytes chunks too: a tiny one is one site per pass
    heads = hs.patch_sweep(
        model, CLEAN, CORRUPT, logit_diff, hs.blocks(model, "attn"), over=("head",)
    )
    with pytest.warns(hs.HookscopeWarning, match="max_bytes=1 is less than one site's pass"):
        tiny = hs.patch_sweep(
            model, CLEAN, CORRUPT, logit_diff, hs.blocks(model, "attn"), over=("head",), max_bytes=1
        )
    assert torch.allclose(tiny, heads, atol=1e-6)
    # batched rows start at the patched block: the blocks before it run on the 2 rows only
    rows = []

    def count(m, a, o):
        rows.append((o[0] if isinstance(o, tuple) else o).shape[0])

    hooks = [b.register_forward_hook(count) for b in hs.blocks(model).values()]
    try:
        hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, over=("head",))
    finally:
        for h in hooks:
            h.remove()
    # the clean run twice (the second checks the forward repeats exactly) and the corrupted run;
    # a pass, the last block fanned out to 4 heads x 2 rows; its first and its last site alone
    assert rows == [2] * 11 + [8] + [2] * 6


def test_reverse_patches_corrupt_into_clean():
    model = tiny_gpt2(n_layer=2)
    blocks = hs.blocks(model)
    got = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, blocks, at="input", reverse=True)
    ref = torch.stack(
        [
            hand_sweep(
                model,
                b,
                "input",
                {"input_ids": CORRUPT},
                {"input_ids": CLEAN},
                logit_diff,
                by_position,
            )
            for b in blocks.values()
        ]
    )
    assert torch.allclose(got, ref, atol=1e-5)


def test_llama_gqa_heads_equal_hand_written_hooks():
    model = tiny_llama(n_layer=2, heads=4, kv_heads=2)
    attn = hs.blocks(model, "self_attn")
    got = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, over=("head",))
    ref = torch.stack(
        [
            hand_sweep(
                model,
                a.o_proj,
                "input",
                {"input_ids": CLEAN},
                {"input_ids": CORRUPT},
                logit_diff,
                by_head(4),
            )
            for a in attn.values()
        ]
    )
    assert got.shape == (2, 4)  # query heads, not the 2 key/value heads
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_neox_and_bert_heads_found_and_exact():
    neox, bert = tiny_neox(), tiny_bert()
    s = head_split("gpt_neox.layers.1.attention", neox.gpt_neox.layers[1].attention)
    assert (s.proj, s.heads, s.head_dim) == ("gpt_neox.layers.1.attention.dense", 4, 16)
    s = head_split("encoder.layer.0.attention", bert.encoder.layer[0].attention)
    assert (s.proj, s.heads, s.head_dim) == ("encoder.layer.0.attention.output.dense", 4, 16)

    def first_token(out):  # an encoder: a metric of the [CLS] position's hidden state
        return out.last_hidden_state[:, 0, :8].sum()

    for model, metric, att in [(neox, logit_diff, "attention"), (bert, first_token, "attention")]:
        layer = list(hs.blocks(model, att).items())[1]
        got = hs.patch_sweep(model, CLEAN, CORRUPT, metric, layer[0], over=("head",))
        proj = dict(model.named_modules())[head_split(*layer).proj]
        ref = hand_sweep(
            model, proj, "input", {"input_ids": CLEAN}, {"input_ids": CORRUPT}, metric, by_head(4)
        )
        assert torch.allclose(got[0], ref, atol=1e-5), (type(model).__name__, got, ref)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_equal_hand_written_hooks(side):
    tok = word_tokenizer(side)
    model = tiny_gpt2(n_layer=2)
    clean = tok(
        [
            "when mary and john went to the store john gave a bag to",
            "mary and john went to the park and john said",
        ],
        return_tensors="pt",
        padding=True,
    )
    corrupt = tok(
        [
            "when mary and john went to the store mary gave a bag to",
            "mary and john went to the park and mary said",
        ],
        return_tensors="pt",
        padding=True,
    )
    assert (clean["attention_mask"] == 0).any()
    last = clean["attention_mask"].sum(1) - 1 if side == "right" else torch.tensor([-1, -1])

    def metric(out):
        lg = out.logits[torch.arange(2), last]
        return (lg[:, MARY] - lg[:, JOHN]).mean()

    blocks = hs.blocks(model)
    got = hs.patch_sweep(model, dict(clean), dict(corrupt), metric, blocks, at="input")
    ref = torch.stack(
        [
            hand_sweep(model, b, "input", dict(clean), dict(corrupt), metric, by_position)
            for b in blocks.values()
        ]
    )
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_misaligned_runs_raise_naming_the_positions():
    tok = word_tokenizer("left")
    model = tiny_gpt2(n_layer=1)
    clean = tok(["mary went to the store", "john went"], return_tensors="pt", padding=True)
    corrupt = tok(["mary went to the store", "john went to"], return_tensors="pt", padding=True)
    with pytest.raises(hs.PatchingError, match=r"attention_mask differs at \(row 1, position 2\)"):
        hs.patch_sweep(model, dict(clean), dict(corrupt), logit_diff, hs.blocks(model))
    with pytest.raises(hs.PatchingError, match=r"shape \(2, 13\) against \(2, 12\)"):
        hs.patch_sweep(model, CLEAN, CORRUPT[:, 1:], logit_diff, hs.blocks(model))
    # padding in the ids without a mask: found through the model's pad_token_id
    ids = CORRUPT.clone()
    ids[0, 0] = 0
    with pytest.raises(hs.PatchingError, match=r"\(row 0, position 0\)"):
        hs.patch_sweep(model, CLEAN, ids, logit_diff, hs.blocks(model))
    with pytest.raises(hs.PatchingError, match="missing in corrupt"):
        hs.patch_sweep(
            model, dict(clean), {"input_ids": clean["input_ids"]}, logit_diff, "transformer.h.0"
        )


def test_attribution_equals_autograd_by_hand():
    model = tiny_llama(n_layer=2)
    blocks = hs.blocks(model)
    got = hs.attribution_patch(model, CLEAN, CORRUPT, logit_diff, blocks, at="input")
    heads = hs.attribution_patch(
        model, CLEAN, CORRUPT, logit_diff, hs.blocks(model, "self_attn"), over=("position", "head")
    )

    def inputs_of(mods, ids, grad):
        acts, hooks = [], []
        for m in mods:
            hooks.append(
                m.register_forward_pre_hook(
                    lambda m, a, k: acts.append(hidden_of(a, k)[1]) and None, with_kwargs=True
                )
            )
        try:
            with torch.set_grad_enabled(grad):
                out = model(ids)
        finally:
            for h in hooks:
                h.remove()
        return acts, out

    for mods, result, split in [
        (list(blocks.values()), got, None),
        ([a.o_proj for a in hs.blocks(model, "self_attn").values()], heads, 4),
    ]:
        clean_acts, _ = inputs_of(mods, CLEAN, False)
        acts, out = inputs_of(mods, CORRUPT, True)
        grads = torch.autograd.grad(logit_diff(out), acts)
        ref = []
        for c, a, g in zip(clean_acts, acts, grads):
            prod = (c - a.detach()) * g
            if split is None:
                ref.append(prod.sum((0, 2)))
            else:
                ref.append(prod.view(*prod.shape[:-1], split, -1).sum((0, 3)))
        ref = torch.stack(ref)
        assert result.shape == ref.shape and ref.abs().max() > 1e-4
        assert torch.allclose(result, ref, atol=1e-6, rtol=1e-5), (result - ref).abs().max()
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated in the model


def test_attribution_top_k_reruns_the_exact_patch():
    model = tiny_gpt2(n_layer=2)
    attn = hs.blocks(model, "attn")
    scores, exact = hs.attribution_patch(
        model, CLEAN, CORRUPT, logit_diff, attn, over=("head",), top_k=3
    )
    full = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, attn, over=("head",))
    with torch.no_grad():
        base = logit_diff(model(CORRUPT))
    picked = ~exact.isnan()
    assert picked.sum() == 3
    assert set(scores.abs().flatten().topk(3).indices.tolist()) == set(
        picked.flatten().nonzero().flatten().tolist()
    )
    assert torch.allclose(exact[picked], (full - base)[picked], atol=1e-6)


@pytest.mark.slow
def test_compiled_model_equals_eager():
    model = tiny_gpt2(n_layer=1)  # one block: compiling is most of the cost
    kw = dict(over=("position", "head"))
    eager = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, hs.blocks(model, "attn"), **kw)
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    got = hs.patch_sweep(compiled, CLEAN, CORRUPT, logit_diff, hs.blocks(compiled, "attn"), **kw)
    assert list(hs.blocks(compiled, "attn")) == list(hs.blocks(model, "attn"))  # eager names
    assert torch.allclose(got, eager, atol=1e-5), (got - eager).abs().max()


class _LateBias(nn.Module):
    """A model that adds a per-row value computed from its input after the blocks: rows cannot
    fan out from a block (the value has the batch's rows), so the sweep tiles the inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(3, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        bias = x.sum(-1, keepdim=True)  # (B, T, 1), not through a module
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h) + bias


def test_a_model_that_cannot_fan_out_warns_and_stays_exact():
    model = _LateBias().eval()
    clean, corrupt = torch.randn(2, 4, 3), torch.randn(2, 4, 3)

    def metric(y):
        return y[:, -1].sum()

    with pytest.warns(hs.HookscopeWarning) as caught:
        got = hs.patch_sweep(model, clean, corrupt, metric, hs.blocks(model))
    assert [str(w.message).split(" (")[0] for w in caught] == [
        f"patch_sweep: rows batched from 'blocks.{i}' on did not reproduce a site patched alone at layer 'blocks.{i}'"
        for i in (0, 1)
    ]
    assert "inputs tiled instead" in str(caught[0].message)
    ref = torch.stack(
        [
            hand_sweep(model, b, "output", {"x": clean}, {"x": corrupt}, metric, by_position)
            for b in model.blocks
        ]
    )
    assert torch.allclose(got, ref, atol=1e-6)


def test_blocks_and_a_selection_that_mixes_nesting_levels():
    bert = tiny_bert()
    assert list(hs.blocks(bert)) == ["encoder.layer.0", "encoder.layer.1"]
    assert len(hs.find(bert, "encoder.layer.*")) > 30  # '*' spans dots
    with pytest.raises(
        hs.PatchingError,
        match=r"mix nesting levels: 'encoder.layer.0' contains .*hs.blocks\(model\)",
    ):
        hs.patch_sweep(bert, CLEAN, CORRUPT, lambda o: o.last_hidden_state.sum(), "encoder.layer.*")
    with pytest.raises(
        hs.LayerNotFoundError, match="no submodule 'atention'; closest names under it: 'attention'"
    ):
        hs.blocks(bert, "atention")
    with pytest.raises(hs.LayerNotFoundError, match="no repeated blocks"):
        hs.blocks(nn.Linear(2, 2))


def test_what_cannot_work_raises_naming_the_fix():
    model = tiny_gpt2(n_layer=1)
    with pytest.raises(hs.PatchingError, match=r"over=\('head', 'position'\).*valid"):
        hs.patch_sweep(
            model, CLEAN, CORRUPT, logit_diff, "transformer.h.0.attn", over=("head", "position")
        )
    # heads of a block: two output projections (attention and MLP), so name the module
    with pytest.raises(
        hs.HeadSplitError, match=r"'transformer.h.0'.*'attn.c_proj', 'mlp.c_proj'.*head_proj="
    ):
        hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, "transformer.h.0", over=("head",))
    with pytest.raises(
        hs.HeadSplitError, match=r"'transformer.h.0.mlp'.*not a multiple of 5 heads; pass n_heads="
    ):
        hs.patch_sweep(
            model, CLEAN, CORRUPT, logit_diff, "transformer.h.0.mlp", over=("head",), n_heads=5
        )
    bert = tiny_bert(n_layer=1)
    with pytest.raises(hs.HeadSplitError, match=r"'encoder.layer.0.attention.self'.*head_proj="):
        head_split("encoder.layer.0.attention.self", bert.encoder.layer[0].attention.self)
    with pytest.raises(hs.PatchingError, match="'attn.out_proj' never ran.*MultiheadAttention"):
        hs.patch_sweep(
            _MHA(),
            torch.randn(1, 3, 4),
            torch.randn(1, 3, 4),
            lambda y: y.sum(),
            "attn",
            over=("head",),
        )
    with pytest.raises(hs.PatchingError, match=r"must return a scalar.*shape \(2,\)"):
        hs.patch_sweep(model, CLEAN, CORRUPT, lambda o: o.logits[:, -1, 0], hs.blocks(model))
    model.train()
    try:
        with pytest.raises(hs.PatchingError, match=r"draws random numbers.*model.eval\(\)"):
            hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, hs.blocks(model))
    finally:
        model.eval()
    with pytest.raises(hs.PatchingError, match="arg="):
        hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, "transformer.h.0", at="input", arg="nope")


class _MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_heat_map_shows_the_values_with_layer_names_and_tokens(tmp_path):
    model = tiny_gpt2(n_layer=2)
    tok = word_tokenizer()
    blocks = list(hs.blocks(model))
    res = hs.patch_sweep(model, CLEAN, CORRUPT, logit_diff, blocks, at="input")
    fig = hs.plot_patching(res, blocks, tokens=CLEAN[0], tokenizer=tok, path=tmp_path / "p.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == tok.convert_ids_to_tokens(
        CLEAN[0].tolist()
    )
    assert [t.get_text() for t in ax.get_yticklabels()] == blocks
    assert torch.equal(torch.as_tensor(ax.images[0].get_array().data), res)
    assert (tmp_path / "p.png").stat().st_size > 1000
    heads = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    ax = hs.plot_patching(heads, ["a", "b"]).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][:5] == [
        "a h0",
        "a h1",
        "a h2",
        "a h3",
        "b h0",
    ]
    assert torch.equal(torch.as_tensor(ax.images[0].get_array().data)[1], heads[0, :, 1])
    with pytest.raises(ValueError, match="3 tokens for 13 columns"):
        hs.plot_patching(res, blocks, tokens=["a", "b", "c"])


class _Attn(nn.Module):
    """An attention-like module with an output projection and no head count anywhere."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o_proj = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o_proj(torch.softmax(q @ k.transpose(1, 2), -1) @ v)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.lin(x))


class _FixedBatch(nn.Module):
    """Hard-codes its batch of 2: no batched rows can work, neither fanned out nor tiled."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x)).view(2, -1)


def test_more_paths_that_cannot_work_raise():
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    attn = _Attn()
    with pytest.raises(
        hs.HeadSplitError, match=r"'<root>' \(_Attn\) declares no attention heads.*pass n_heads="
    ):
        hs.patch_sweep(attn, x, y, lambda o: o.sum(), "", over=("head",))
    got = hs.patch_sweep(attn, x, y, lambda o: o.sum(), "", over=("head",), n_heads=2)
    ref = hand_sweep(attn, attn.o_proj, "input", {"x": x}, {"x": y}, lambda o: o.sum(), by_head(2))
    assert torch.allclose(got[0], ref, atol=1e-5)
    with pytest.raises(hs.HeadSplitError, match=r"head_proj='out'.*Linear-like modules there: \['o_proj', 'qkv'\]"):  # fmt: skip
        hs.patch_sweep(attn, x, y, lambda o: o.sum(), "", over=("head",), head_proj="out")
    with pytest.raises(hs.PatchingError, match="'lin' ran 2 times in one forward pass"):
        hs.patch_sweep(_Twice(), x, y, lambda o: o.sum(), "lin")
    # neither fanned out nor tiled can work: one site per pass, as rows= equal to the batch
    fixed = _FixedBatch()
    with pytest.warns(
        hs.HookscopeWarning, match="nor with the model's inputs tiled.*one site per pass"
    ):
        got = hs.patch_sweep(fixed, x, y, lambda o: o.sum(), "a")
    ref = hand_sweep(fixed, fixed.a, "output", {"x": x}, {"x": y}, lambda o: o.sum(), by_position)
    assert torch.allclose(got[0], ref, atol=1e-6)
    ok = hs.patch_sweep(fixed, x, y, lambda o: o.sum(), "a", rows=2)  # one site per pass
    assert torch.allclose(ok, got, atol=1e-6)
    with pytest.raises(hs.PatchingError, match=r"over='position' needs .*\(2, 8\)"):
        hs.patch_sweep(nn.Linear(8, 8), x[:, 0], y[:, 0], lambda o: o.sum(), "")
    with pytest.raises(hs.PatchingError, match="without a gradient"):
        hs.attribution_patch(attn, x, y, lambda o: o.sum().detach(), "", n_heads=2)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        hs.attribution_patch(attn, x, y, lambda o: o.sum(), "", top_k=0)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        hs.patch_sweep(attn, x, y, lambda o: o.sum(), "", rows=0)
    bn = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(3))
    with pytest.raises(
        hs.PatchingError, match=r"batch norm '1' is in training mode.*model.eval\(\)"
    ):
        hs.patch_sweep(bn, x, y, lambda o: o.sum(), "0")
    with pytest.raises(TypeError, match="clean must be a tensor of token ids or a dict"):
        hs.patch_sweep(attn, [1, 2], y, lambda o: o.sum(), "")


# -- random prompts: every position differs (after a shared first token) ---------------------
_g = torch.Generator().manual_seed(5)
RAND_CLEAN = torch.randint(3, 45, (2, 12), generator=_g)
RAND_CORRUPT = (RAND_CLEAN + torch.randint(1, 41, (2, 12), generator=_g) - 3) % 42 + 3
RAND_CORRUPT[:, 0] = RAND_CLEAN[:, 0] = 2  # a shared first token, as a BOS: 1.. all differ
assert (RAND_CLEAN[:, 1:] != RAND_CORRUPT[:, 1:]).all()


def seq_lengths(module):
    """Record the number of positions of every call of ``module`` (its first input)."""
    seen = []

    def hook(m, a, k):
        seen.append(hidden_of(a, k)[1].shape[1])

    return seen, module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "helper", ["get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos"]
)
def test_random_prompts_equal_transformer_lens_from_later_positions(gpt2_and_tl, helper):
    """Every position differs: the passes run only from the patched position on (the last block
    sees fewer than T positions) and still equal TransformerLens."""
    import transformer_lens.patching as tlp

    model, bridge, _ = gpt2_and_tl
    _, cache = bridge.run_with_cache(RAND_CLEAN)
    child, at, over = HELPERS[helper]
    ref = getattr(tlp, helper)(bridge, RAND_CORRUPT, cache, logit_diff)
    seen, h = seq_lengths(model.transformer.h[-1])
    try:
        got = hs.patch_sweep(
            model, RAND_CLEAN, RAND_CORRUPT, logit_diff, hs.blocks(model, child), at=at, over=over
        )
    finally:
        h.remove()
    assert ref.abs().max() > 1e-3 and (ref[:, 1:] != ref[0, 1]).any()
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    T = RAND_CLEAN.shape[1]
    assert min(seen) < T and max(seen) == T  # sliced passes ran; full ones (the records, a check)
    assert sum(n < T for n in seen) >= 3


def test_llama_gqa_random_prompts_equal_hand_written_hooks():
    model = tiny_llama(n_layer=2, heads=4, kv_heads=2)
    attn = hs.blocks(model, "self_attn")
    clean, corrupt = {"input_ids": RAND_CLEAN}, {"input_ids": RAND_CORRUPT}
    seen, h = seq_lengths(model.model.layers[1])
    try:
        heads = hs.patch_sweep(
            model, RAND_CLEAN, RAND_CORRUPT, logit_diff, attn, over=("position", "head")
        )
        whole = hs.patch_sweep(model, RAND_CLEAN, RAND_CORRUPT, logit_diff, attn, over=("head",))
        resid = hs.patch_sweep(
            model, RAND_CLEAN, RAND_CORRUPT, logit_diff, hs.blocks(model), at="input"
        )
    finally:
        h.remove()
    T = RAND_CLEAN.shape[1]
    assert min(seen) == 1 and T - 1 in seen  # from the last position; heads from position 1
    for got, mods, kind, cut, shape in [
        (heads, [a.o_proj for a in attn.values()], "input", by_pos_head(4), (2, T, 4)),
        (whole, [a.o_proj for a in attn.values()], "input", by_head(4), (2, 4)),
        (resid, list(hs.blocks(model).values()), "input", by_position, (2, T)),
    ]:
        ref = torch.stack(
            [hand_sweep(model, m, kind, clean, corrupt, logit_diff, cut) for m in mods]
        ).view(shape)
        assert ref.abs().max() > 1e-3
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_random_prompts_equal_hand_written_hooks(side):
    tok = word_tokenizer(side)
    model = tiny_gpt2(n_layer=2)
    g = torch.Generator().manual_seed(7)
    words = tok.convert_ids_to_tokens(list(range(3, 45)))

    def text(n):
        return " ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=g))

    clean = tok([text(10), text(7)], return_tensors="pt", padding=True)
    corrupt = tok([text(10), text(7)], return_tensors="pt", padding=True)
    assert (clean["attention_mask"] == 0).any()
    real = clean["attention_mask"].bool()
    assert (clean["input_ids"] != corrupt["input_ids"])[real].float().mean() > 0.8
    last = clean["attention_mask"].sum(1) - 1 if side == "right" else torch.tensor([-1, -1])

    def metric(out):
        lg = out.logits[torch.arange(2), last]
        return (lg[:, MARY] - lg[:, JOHN]).mean()

    blocks = hs.blocks(model)
    seen, h = seq_lengths(model.transformer.h[1])
    try:
        got = hs.patch_sweep(model, dict(clean), dict(corrupt), metric, blocks, at="input")
        heads = hs.patch_sweep(
            model,
            dict(clean),
            dict(corrupt),
            metric,
            "transformer.h.1.attn",
            over=("position", "head"),
        )
    finally:
        h.remove()
    assert min(seen) < clean["input_ids"].shape[1]
    ref = torch.stack(
        [
            hand_sweep(model, b, "input", dict(clean), dict(corrupt), metric, by_position)
            for b in blocks.values()
        ]
    )
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    ref = hand_sweep(
        model,
        model.transformer.h[1].attn.c_proj,
        "input",
        dict(clean),
        dict(corrupt),
        metric,
        by_pos_head(4),
    ).view(heads.shape[1:])
    assert torch.allclose(heads[0], ref, atol=1e-5), (heads[0] - ref).abs().max()


def _length_biased_gpt2():
    """A GPT-2 whose logits depend on how many positions a call gets: a pass over the later
    positions only (the earlier ones from the cache) differs from a full run."""
    from transformers import GPT2LMHeadModel

    class LengthBiased(GPT2LMHeadModel):
        def forward(
            self, input_ids=None, past_key_values=None, attention_mask=None, use_cache=None, **kw
        ):
            out = super().forward(
                input_ids=input_ids,
                past_key_values=past_key_values,
                attention_mask=attention_mask,
                use_cache=use_cache,
                **kw,
            )
            out.logits = out.logits + 0.1 * input_ids.shape[1]
            return out

    base = tiny_gpt2(n_layer=2)
    model = LengthBiased(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model


def test_a_cache_pass_that_differs_from_a_full_run_warns_and_stays_exact():
    model = _length_biased_gpt2()
    blocks = hs.blocks(model)
    with pytest.warns(hs.HookscopeWarning) as caught:
        got = hs.patch_sweep(model, RAND_CLEAN, RAND_CORRUPT, logit_diff, blocks, at="input")
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2 and all("key/value cache" in m and "full length" in m for m in msgs)
    assert "at layer 'transformer.h.0'" in msgs[0] and "at layer 'transformer.h.1'" in msgs[1]
    assert "logits differs by" in msgs[0]
    ref = torch.stack(
        [
            hand_sweep(
                model,
                b,
                "input",
                {"input_ids": RAND_CLEAN},
                {"input_ids": RAND_CORRUPT},
                logit_diff,
                by_position,
            )
            for b in blocks.values()
        ]
    )
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


@pytest.mark.slow
def test_attribution_on_a_compiled_model_equals_eager():
    model = tiny_gpt2(n_layer=1)
    attn = hs.blocks(model, "attn")
    eager = hs.attribution_patch(model, CLEAN, CORRUPT, logit_diff, attn, over=("position", "head"))
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    got = hs.attribution_patch(
        compiled, CLEAN, CORRUPT, logit_diff, hs.blocks(compiled, "attn"), over=("position", "head")
    )
    assert eager.abs().max() > 1e-4
    assert torch.allclose(got, eager, atol=1e-6, rtol=1e-5), (got - eager).abs().max()


class _HeadsOf(_Attn):
    def __init__(self, heads):
        super().__init__()
        self.num_heads = heads


def test_layers_with_different_head_counts_raise():
    model = nn.Sequential(_HeadsOf(2), _HeadsOf(4))
    x, y = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(
        hs.PatchingError, match=r"different shapes \[\(2,\), \(4,\)\]; sweep them separately"
    ):
        hs.patch_sweep(model, x, y, lambda o: o.sum(), ["0", "1"], over=("head",))


def test_plan_from_groups_sites_by_first_position_within_the_budget():
    from hookscope.patching._batching import plan_from

    firsts = [p for p in range(16) for _ in range(3)] + [0, 5]  # 3 heads a position, 2 more

    def row_bytes(p0):
        return 100 * (16 - p0) // 16 + 10

    for shared in (0.0, 3.0):
        passes = plan_from(firsts, 16, 2, bytes_per_row=row_bytes, budget=2_000, shared=shared)
        assert sorted(i for _, c in passes for i in c) == list(range(len(firsts)))
        for p0, c in passes:
            assert p0 == min(firsts[i] for i in c)  # a pass starts at its earliest site
            assert len(c) * 2 * row_bytes(p0) <= 2_000  # and fits the budget at that start
    # with room for every site, the passes are the cheapest cut of the first positions: a pass
    # costs length / 4 and (sites + shared) * (length - p0); checked against every cut
    length, groups = 16, sorted(set(firsts))
    count = {p: firsts.count(p) for p in groups}

    def cost(cut):
        return sum(length / 4 + sum(count[p] for p in part) * (length - part[0]) for part in cut)

    def cuts(ps):
        if not ps:
            yield []
            return
        for i in range(1, len(ps) + 1):
            for rest in cuts(ps[i:]):
                yield [ps[:i], *rest]

    small = [p for p in firsts if p < 6]
    got = plan_from(small, length, 2, bytes_per_row=row_bytes, budget=10**9)
    best = min(cost(c) for c in cuts(sorted(set(small))))
    got_parts = [sorted({small[i] for i in c}) for _, c in got]
    assert cost(got_parts) == best and 1 < len(got) < len(set(small))
    assert plan_from(firsts, 16, 2, bytes_per_row=row_bytes, budget=0, rows=4)[0] == (0, [0, 1])
