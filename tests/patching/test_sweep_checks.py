"""Every value a sweep returns is checked or exact by construction: a model that mixes the rows of
a batch falls back to one site per pass, an out-of-memory pass is halved; the mode check asks the
run whether it draws random numbers; heads only where a module declares them; one-line errors for
what cannot work; another thread's forwards; encoder-decoder models."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.lm import tiny_gpt2, tiny_llama
from helpers.patch_refs import by_head, by_position, hand_sweep


def _sum_last(y):
    return y[:, -1].sum()


class _BatchCentred(nn.Module):
    """Blocks that subtract the batch's mean: every row depends on every other row, so copies of
    the batch in one pass (fanned out or tiled) change each other's values."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for b in self.blocks:
            h = torch.tanh(b(x))
            x = h - h.mean(dim=0, keepdim=True)
        return self.head(x)


def _square_last(y):
    return y[:, -1].pow(2).sum()  # not a sum of rows: centring by the batch would cancel in it


def test_a_model_that_mixes_rows_runs_one_site_per_pass_and_stays_exact():
    model = _BatchCentred().eval()
    g = torch.Generator().manual_seed(3)
    clean, corrupt = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    with pytest.warns(hs.HookscopeWarning) as caught:
        got = hs.patch_sweep(model, clean, corrupt, _square_last, hs.blocks(model))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2 and all(
        "nor with the model's inputs tiled" in m and "one site per pass (exact" in m for m in msgs
    ), msgs
    ref = torch.stack(
        [
            hand_sweep(model, b, "output", {"x": clean}, {"x": corrupt}, _square_last, by_position)
            for b in model.blocks
        ]
    )
    assert ref[:, :-1].abs().max() > 0 and (ref[0] - ref[0, 0]).abs().max() > 1e-3
    assert torch.allclose(got, ref, atol=1e-6), (got - ref).abs().max()


class _MemoryBound(nn.Linear):
    """Raises CUDA's out-of-memory error on more than ``limit`` rows, as a device would."""

    limit = 4

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return super().forward(x)


def test_an_out_of_memory_pass_is_halved_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), _MemoryBound(8, 8), nn.Linear(8, 1)).eval()
    clean, corrupt = torch.randn(1, 6, 3), torch.randn(1, 6, 3)
    with pytest.warns(hs.HookscopeWarning, match="ran out of memory") as caught:
        got = hs.patch_sweep(model, clean, corrupt, _sum_last, ["0"])
    msgs = [str(w.message) for w in caught]
    # 6 sites -> 3 per pass -> fits in 4 rows: one halving, said once, naming the sizes
    assert len(msgs) == 1, msgs
    assert "a pass of 6 sites (6 rows) at layer '0'" in msgs[0]
    assert "at most 3 sites (3 rows)" in msgs[0] and "rows=" in msgs[0]
    ref = hand_sweep(
        model, model[0], "output", {"input": clean}, {"input": corrupt}, _sum_last, by_position
    )
    assert torch.allclose(got[0], ref, atol=1e-6)


def _dropout_llama(p):
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tiny_llama(n_layer=1)
    cfg = LlamaConfig(**{**base.config.to_dict(), "attention_dropout": p})
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(base.state_dict())
    return model.train()


def test_functional_dropout_in_training_mode_is_refused_and_a_train_mode_without_draws_is_not():
    ids = torch.tensor([[2, 5, 6, 7, 8]])
    other = torch.tensor([[2, 9, 6, 7, 8]])

    def metric(o):
        return o.logits[:, -1, 5].mean()

    model = _dropout_llama(0.5)  # attention dropout is F.dropout inside attention: no module
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    blocks = hs.blocks(model)
    for verb in (hs.patch_sweep, hs.attribution_patch):
        with pytest.raises(hs.PatchingError, match=r"draws random numbers.*model.eval\(\)"):
            verb(model, ids, other, metric, blocks)
    # in training mode but drawing nothing: the same values as in eval mode
    quiet = _dropout_llama(0.0)
    got = hs.patch_sweep(quiet, ids, other, metric, blocks)
    assert torch.allclose(got, hs.patch_sweep(quiet.eval(), ids, other, metric, blocks), atol=1e-6)


def test_heads_only_where_a_module_declares_them():
    model = tiny_gpt2(n_layer=1)
    clean = torch.tensor([[2, 5, 6, 7]])
    corrupt = torch.tensor([[2, 5, 9, 7]])

    def metric(o):
        return o.logits[:, -1, 5].mean()

    with pytest.raises(
        hs.HeadSplitError, match=r"'transformer.h.0.mlp' \(GPT2MLP\) declares no attention heads"
    ):
        hs.patch_sweep(model, clean, corrupt, metric, hs.blocks(model, "mlp"), over=("head",))
    with pytest.raises(
        hs.HeadSplitError,
        match=r"n_heads=8 but 'transformer.h.0.attn' \(GPT2Attention\) declares 4 heads "
        r"\(num_heads=4\); leave n_heads out or pass n_heads=4",
    ):
        hs.patch_sweep(
            model, clean, corrupt, metric, hs.blocks(model, "attn"), over=("head",), n_heads=8
        )
    with pytest.raises(hs.HeadSplitError, match="n_heads must be a positive number.*got 0"):
        hs.patch_sweep(
            model, clean, corrupt, metric, hs.blocks(model, "attn"), over=("head",), n_heads=0
        )
    # the count it declares, given explicitly, is accepted and exact
    got = hs.patch_sweep(
        model, clean, corrupt, metric, hs.blocks(model, "attn"), over=("head",), n_heads=4
    )
    attn = model.transformer.h[0].attn
    ref = hand_sweep(
        model,
        attn.c_proj,
        "input",
        {"input_ids": clean},
        {"input_ids": corrupt},
        metric,
        by_head(4),
    )
    assert torch.allclose(got[0], ref, atol=1e-5)


def test_what_cannot_work_is_one_line_naming_the_argument():
    model = tiny_gpt2(n_layer=1)
    clean = torch.tensor([[2, 5, 6, 7]])
    corrupt = torch.tensor([[2, 5, 9, 7]])
    blocks = hs.blocks(model)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(1, 2, 3)
    calls = [
        (hs.patch_sweep, (model, clean, corrupt, lambda o: None, blocks), "returned NoneType"),
        (hs.patch_sweep, (model, clean, corrupt, lambda o: "0.5", blocks), "returned str"),
        (
            hs.attribution_patch,
            (model, clean, corrupt, lambda o: None, blocks),
            "returned NoneType",
        ),
        (hs.attribution_patch, (model, clean, corrupt, lambda o: "0.5", blocks), "returned str"),
        (hs.patch_sweep, (meta, x, x + 1, _sum_last, ["0"]), r"meta device \('0.weight'.*to_empty"),
        (hs.attribution_patch, (meta, x, x + 1, _sum_last, ["0"]), r"meta device \('0.weight'"),
    ]
    for verb, args, match in calls:
        with pytest.raises(hs.PatchingError, match=match) as caught:
            verb(*args)
        assert "\n" not in str(caught.value)
        if "returned" in match:
            assert "metric must return a number" in str(caught.value)
            assert "at layer 'transformer.h.0'" in str(caught.value)
    with torch.inference_mode(), pytest.raises(hs.PatchingError) as caught:
        hs.attribution_patch(model, clean, corrupt, lambda o: o.logits.sum(), blocks)
    assert "\n" not in str(caught.value)
    assert "torch.inference_mode(); call it outside that block" in str(caught.value)


def test_a_sweep_beside_another_threads_forwards_is_exact_and_leaves_them_alone():
    model = tiny_gpt2(n_layer=2)
    clean = torch.tensor([[2, 5, 6, 7, 8, 9]])
    corrupt = torch.tensor([[2, 5, 6, 10, 8, 9]])
    other = torch.tensor([[3, 4, 5, 6, 7, 8]])

    def metric(o):
        return o.logits[:, -1, 5].mean()

    blocks = hs.blocks(model)
    ref = hs.patch_sweep(model, clean, corrupt, metric, blocks, at="input")
    with torch.no_grad():
        expected = model(other).logits
    stop, seen, errors = threading.Event(), [], []

    def forwards():
        try:
            while not stop.is_set():
                with torch.no_grad():
                    seen.append(model(other).logits)
        except Exception as e:
            errors.append(e)

    worker = threading.Thread(target=forwards)
    worker.start()
    try:
        got = [hs.patch_sweep(model, clean, corrupt, metric, blocks, at="input") for _ in range(3)]
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert len(seen) > 3  # the forwards did run during the sweeps
    assert all(torch.allclose(s, expected, atol=1e-6) for s in seen)
    for g in got:
        assert torch.allclose(g, ref, atol=1e-6), (g - ref).abs().max()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return (
        T5ForConditionalGeneration(cfg).eval(),
        "encoder.block",
        "decoder.block",
        "layer.0.SelfAttention.o",
    )


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(
        vocab_size=50, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64,
    )  # fmt: skip
    stacks = ("model.encoder.layers", "model.decoder.layers", "self_attn.out_proj")
    return BartForConditionalGeneration(cfg).eval(), *stacks


@pytest.mark.parametrize("make", [_t5, _bart], ids=["t5", "bart"])
def test_encoder_decoder_blocks_equal_hand_written_hooks(make):
    model, enc_stack, dec_stack, out_proj = make()
    g = torch.Generator().manual_seed(1)
    enc, dec = torch.randint(3, 50, (2, 7), generator=g), torch.randint(3, 50, (2, 5), generator=g)
    dec2 = dec.clone()
    dec2[:, 2:] = torch.randint(3, 50, (2, 3), generator=g)
    enc2 = enc.clone()
    enc2[:, 3] = (enc[:, 3] + 1) % 50

    def metric(o):
        return (o.logits[:, -1, 5] - o.logits[:, -1, 6]).mean()

    modules = dict(model.named_modules())
    for stack, clean, corrupt in (
        (dec_stack, {"input_ids": enc, "decoder_input_ids": dec}, {"input_ids": enc, "decoder_input_ids": dec2}),
        (enc_stack, {"input_ids": enc, "decoder_input_ids": dec}, {"input_ids": enc2, "decoder_input_ids": dec}),
    ):  # fmt: skip
        layers = [f"{stack}.{i}" for i in range(2)]
        got = hs.patch_sweep(model, clean, corrupt, metric, layers)
        ref = torch.stack(
            [
                hand_sweep(model, modules[n], "output", clean, corrupt, metric, by_position)
                for n in layers
            ]
        )
        assert ref.abs().max() > 1e-4
        assert torch.allclose(got, ref, atol=1e-5), (stack, (got - ref).abs().max())
        scores = hs.attribution_patch(model, clean, corrupt, metric, layers)
        ref = torch.stack(
            [_attribution_by_hand(model, modules[n], clean, corrupt, metric) for n in layers]
        )
        assert torch.allclose(scores, ref, atol=1e-6, rtol=1e-5), (scores - ref).abs().max()
    # heads of the decoder's self-attention: the input of its output projection, 4 heads
    clean = {"input_ids": enc, "decoder_input_ids": dec}
    corrupt = {"input_ids": enc, "decoder_input_ids": dec2}
    attn = [f"{dec_stack}.{i}.{out_proj.rsplit('.', 1)[0]}" for i in range(2)]
    got = hs.patch_sweep(model, clean, corrupt, metric, attn, over=("head",))
    projs = [modules[f"{dec_stack}.{i}.{out_proj}"] for i in range(2)]
    ref = torch.stack(
        [hand_sweep(model, p, "input", clean, corrupt, metric, by_head(4)) for p in projs]
    )
    assert ref.abs().max() > 1e-4 and torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # the two stacks see sequences of different lengths: a selection mixing them is refused
    both = [f"{enc_stack}.1", f"{dec_stack}.0"]  # 7 encoder positions, 5 decoder positions
    for verb in (hs.patch_sweep, hs.attribution_patch):
        with pytest.raises(
            hs.PatchingError,
            match=rf"different shapes \[\(5,\), \(7,\)\]; sweep them separately: \(5,\) from '{dec_stack}.0'",
        ):
            verb(model, clean, corrupt, metric, both)


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def _attribution_by_hand(model, module, clean, corrupt, metric):
    """(clean - corrupt) . d metric / d output at the corrupted run, per position: plain hooks
    and torch.autograd.grad."""
    store = {}
    h = module.register_forward_hook(lambda m, a, o: store.__setitem__("clean", _first(o).detach()))
    try:
        with torch.no_grad():
            model(**clean)
    finally:
        h.remove()

    def keep(m, a, o):
        store["act"] = _first(o)

    h = module.register_forward_hook(keep)
    try:
        value = metric(model(**corrupt))
    finally:
        h.remove()
    (grad,) = torch.autograd.grad(value, store["act"])
    model.zero_grad(set_to_none=True)
    return ((store["clean"] - store["act"].detach()) * grad).sum(dim=(0, 2))
