"""Audit of silent wrong results in the language-model sweeps: each test fails on the code
before its fix, and proves the values against hand-written hooks (one forward per site)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.lm import EOS, PAD, WORDS
from helpers.patch_refs import by_position, hand_sweep


def _gpt2_classifier(num_labels: int):
    """A random-weight ``GPT2ForSequenceClassification``: its logits are pooled at each row's last
    real token, found from ``input_ids`` (a head that reads every position of the call)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg = GPT2Config(
        vocab_size=len(WORDS),
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=64,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_labels=num_labels,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(cfg).eval()


def _runs(pad_from: int | None, length: int = 8):
    """Clean and corrupted runs of 2 rows that share their first 2 tokens; row 1 right-padded
    from ``pad_from`` on."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, len(WORDS), (2, length), generator=g)
    corrupt = torch.randint(3, len(WORDS), (2, length), generator=g)
    corrupt[:, :2] = clean[:, :2]
    mask = torch.ones(2, length, dtype=torch.long)
    if pad_from is not None:
        mask[1, pad_from:] = 0
        clean[1, pad_from:] = PAD
        corrupt[1, pad_from:] = PAD
    return {"input_ids": clean, "attention_mask": mask}, {
        "input_ids": corrupt,
        "attention_mask": mask.clone(),
    }


def _pooled_metric(out):
    return out.logits[1, 0] + 0.5 * out.logits[0, 1]


def _reference(model, names, clean, corrupt, metric):
    return torch.stack(
        [
            hand_sweep(model, model.get_submodule(n), "output", clean, corrupt, metric, by_position)
            for n in names
        ]
    )


@pytest.mark.parametrize("rows", [None, 2])
def test_a_pooled_head_over_right_padded_rows_equals_hand_written_hooks(rows):
    # A pass from position p0 on (the earlier positions from the corrupted run's cache) gave a
    # head that pools at each row's last real token only the positions p0..: for row 1, padded
    # from position 4 on, every pass from p0 >= 4 pooled a padding position. Only the first
    # such pass was checked against a full run, so the later ones were silently wrong.
    model = _gpt2_classifier(3)
    clean, corrupt = _runs(pad_from=4)
    names = ["transformer.h.0", "transformer.h.1"]
    with warnings.catch_warnings():
        # the head reads the inputs' batch size: batched passes fall back, with a warning
        warnings.simplefilter("ignore", hs.HookscopeWarning)
        got = hs.patch_sweep(model, clean, corrupt, _pooled_metric, names, rows=rows)
    ref = _reference(model, names, clean, corrupt, _pooled_metric)
    assert (ref[:, 4:] - ref[:, :1]).abs().max() > 1e-3  # the late sites do change the metric
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_a_head_that_reads_the_first_copy_of_a_cached_pass_is_not_copied_to_every_site():
    # GPT-2's classification head indexes its logits with the batch size of input_ids (2 rows),
    # so a pass of k sites fanned out after the embeddings returned copy 0's rows only; the
    # passes from later positions did not check the output's rows, and every site of a pass got
    # the first site's value. (num_labels == the length: the logits look like a position axis.)
    model = _gpt2_classifier(8)
    clean, corrupt = _runs(pad_from=None)
    names = ["transformer.h.0", "transformer.h.1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hs.HookscopeWarning)  # the fallback is announced
        got = hs.patch_sweep(model, clean, corrupt, _pooled_metric, names)
    ref = _reference(model, names, clean, corrupt, _pooled_metric)
    assert (ref[:, 3:] - ref[:, 2:3]).abs().max() > 1e-3
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_an_output_indexed_by_the_inputs_batch_size_in_a_cached_pass_is_checked():
    # The same head with a position axis: logits gathered with torch.arange(input_ids.shape[0])
    # keep copy 0's rows of a pass of k sites. Passes from later positions did not check the
    # output's rows either, so every site of such a pass got its first site's value.
    from transformers import GPT2LMHeadModel

    from helpers.lm import tiny_gpt2

    class FirstRows(GPT2LMHeadModel):
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
            out.logits = out.logits[torch.arange(input_ids.shape[0])]
            return out

    base = tiny_gpt2(n_layer=2)
    model = FirstRows(base.config).eval()
    model.load_state_dict(base.state_dict())
    clean, corrupt = _runs(pad_from=None)

    def metric(out):
        return out.logits[0, -1, 7] - out.logits[1, -1, 8]

    names = ["transformer.h.0", "transformer.h.1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hs.patch_sweep(model, clean, corrupt, metric, names)
    ref = _reference(model, names, clean, corrupt, metric)
    assert (ref[:, 3:] - ref[:, 2:3]).abs().max() > 1e-3
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    said = [str(w.message) for w in caught if issubclass(w.category, hs.HookscopeWarning)]
    assert len(said) == 2 and all(
        "rows); that layer ran with the model's inputs" in m for m in said
    )


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_rows_follow_the_order_of_the_layers_given(fn):
    # The rows came back in the model's order whatever the order of the list given, so
    # layers=["transformer.h.2", "transformer.h.0"] gave h.0's values in row 0, silently.
    from helpers.lm import tiny_gpt2

    model = tiny_gpt2(n_layer=3)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, len(WORDS), (1, 6), generator=g)
    corrupt = torch.randint(3, len(WORDS), (1, 6), generator=g)

    def metric(out):
        return out.logits[0, -1, 7]

    sweep = getattr(hs, fn)
    got = sweep(model, clean, corrupt, metric, ["transformer.h.2", "transformer.h.0"])
    for row, name in enumerate(["transformer.h.2", "transformer.h.0"]):
        mod = model.get_submodule(name)
        if fn == "patch_sweep":
            ref = hand_sweep(
                model,
                mod,
                "output",
                {"input_ids": clean},
                {"input_ids": corrupt},
                metric,
                by_position,
            )
        else:
            ref = _attribution_by_hand(model, mod, clean, corrupt, metric)
        assert torch.allclose(got[row], ref, atol=1e-5), (name, got[row], ref)
    # a glob or a type inside the list: its layers in the model's order, at its place
    got = sweep(model, clean, corrupt, metric, ["transformer.h.2", "transformer.h.[01]"])
    alone = sweep(model, clean, corrupt, metric, hs.blocks(model))
    assert torch.allclose(got, alone[[2, 0, 1]], atol=1e-6)


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_a_layer_selected_twice_is_refused_not_merged(fn):
    # ["transformer.h.0", "transformer.h.0"] gave one row, not two.
    from helpers.lm import tiny_gpt2

    model = tiny_gpt2(n_layer=2)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(hs.PatchingError, match=r"'transformer.h.0' twice"):
        getattr(hs, fn)(model, ids, ids + 1, lambda o: o.logits[0, -1, 0], ["transformer.h.0"] * 2)
    with pytest.raises(hs.PatchingError, match=r"'transformer.h.1' twice"):
        getattr(hs, fn)(
            model,
            ids,
            ids + 1,
            lambda o: o.logits[0, -1, 0],
            ["transformer.h.1", "transformer.h.*[0-9]"],
        )


def _attribution_by_hand(model, module, clean, corrupt, metric):
    """(clean - corrupt) . d metric / d output of ``module`` at the corrupted run, per position."""
    store = {}

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    h = module.register_forward_hook(lambda m, a, o: store.__setitem__("x", first(o).detach()))
    try:
        with torch.no_grad():
            model(input_ids=clean)
    finally:
        h.remove()
    src = store.pop("x")

    def keep(m, a, o):
        store["x"] = first(o)

    h = module.register_forward_hook(keep)
    try:
        value = metric(model(input_ids=corrupt))
    finally:
        h.remove()
    (grad,) = torch.autograd.grad(value, store["x"])
    return ((src - store["x"].detach()) * grad).sum(dim=(0, 2))


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_a_cache_among_the_inputs_is_refused_before_any_forward(fn):
    # A cache object in clean/corrupt (a prefix's keys and values) grew with every forward: the
    # user's cache was changed, and the sweep stopped with a misleading "random by other means".
    from transformers import DynamicCache

    from helpers.lm import tiny_gpt2

    model = tiny_gpt2(n_layer=2)
    prefix, ids = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[7, 8, 9]])
    cache = DynamicCache()
    with torch.no_grad():
        model(prefix, past_key_values=cache, use_cache=True)
    with pytest.raises(hs.PatchingError, match=r"'past_key_values' in clean.*whole sequence"):
        getattr(hs, fn)(
            model,
            {"input_ids": ids, "past_key_values": cache},
            {"input_ids": ids + 1, "past_key_values": cache},
            lambda o: o.logits[0, -1, 0],
            ["transformer.h.0"],
        )
    assert cache.get_seq_length() == 4  # left as it was
