"""
Activation patching: find the induction heads of a trained model
=================================================================

Activation patching asks *where* a model computes something. Run a clean prompt and a
corrupted one that differs in a key detail, copy one activation of the clean run into the
corrupted run, and measure how much of the clean answer comes back. Done for every layer,
position and attention head, this maps the sites that matter:

* ``hs.patch_sweep(model, clean, corrupt, metric, layers, over=...)``: the metric after each
  patch, shaped ``[layers, *over]``; heads are found under any Hugging Face attention module;
* ``hs.attribution_patch(...)``: a first-order estimate of the same sweep from two forwards
  and one backward;
* ``hs.plot_patching(...)``: a heat map with the layer names and the tokens.

The model is hookscope's demo language model (:func:`hookscope.load_demo_lm`): a two-layer Llama
trained on random token spans that repeat. To predict the second copy it formed **induction
heads** (Olsson et al., 2022): a layer-0 head moves each token's predecessor into its position,
and layer-1 heads look, from the current token, for the position whose predecessor is that
token, and copy what is there. The sweeps below find those heads without being told.
"""

# %%
import matplotlib.pyplot as plt
import torch

import hookscope as hs

torch.set_num_threads(1)
model = hs.load_demo_lm()
prompts = hs.make_induction_prompts(16, 10, seed=0)
L = prompts.length
print("clean    ", prompts.clean[0].tolist())
print("corrupted", prompts.corrupted[0].tolist())


def next_token_logit(out) -> torch.Tensor:
    """The logit of the correct next token over the repeated half, averaged."""
    logits = out.logits[:, prompts.positions]
    return logits.gather(-1, prompts.targets[..., None]).mean()


with torch.no_grad():
    clean_value = float(next_token_logit(model(prompts.clean)))
    corrupt_value = float(next_token_logit(model(prompts.corrupted)))
print(f"clean {clean_value:.3f}  corrupted {corrupt_value:.3f}")


def restored(values: torch.Tensor) -> torch.Tensor:
    """0 where a patch leaves the corrupted run's metric, 1 where it restores the clean one."""
    return (values - corrupt_value) / (clean_value - corrupt_value)


# %%
# Which layers to sweep
# ---------------------
# A glob's ``*`` spans dots, so ``"model.layers.*"`` selects every module *under* the blocks.
# ``hs.blocks`` finds the repeated blocks, and a child of each.
print(len(hs.find(model, "model.layers.*")), "modules under the blocks")
print(list(hs.blocks(model)))
print(list(hs.blocks(model, "self_attn")))

# %%
# The residual stream, layer by position
# --------------------------------------
# ``at="input"`` patches each block's hidden-state input (TransformerLens's ``resid_pre``).
# The heat maps show the share of the clean run's lead restored: ``(metric - corrupted) /
# (clean - corrupted)``, as users of TransformerLens plot it.
resid = restored(
    hs.patch_sweep(model, prompts.clean, prompts.corrupted, next_token_logit, hs.blocks(model), at="input")
)  # fmt: skip
print(resid.numpy().round(2))

fig, ax = plt.subplots(figsize=(9, 2.2))
tokens = [str(t) for t in prompts.clean[0].tolist()]
hs.plot_patching(resid, list(hs.blocks(model)), tokens=tokens, ax=ax, title="resid_pre patching")
fig.tight_layout()

# %%
# Patching one first-copy position at layer 1's input restores its share of the answer (each
# position is the source of one prediction: about ``1 / (L - 1)``); at layer 0's input it
# restores almost nothing. The difference is what layer 0 does: at layer 1 a position also holds
# its *predecessor* (moved there by a layer-0 head), which the induction head matches, and its
# own token, which it copies. At layer 0 a clean token alone sits beside a corrupted
# predecessor, and is never looked up.
first_copy = slice(2, L + 1)
print("layer 0 input, per position:", resid[0, first_copy].numpy().round(2))
print("layer 1 input, per position:", resid[1, first_copy].numpy().round(2))
assert resid[1, first_copy].sum() > 0.7 and resid[0, first_copy].abs().max() < 0.1

# %%
# Attention heads
# ---------------
# Heads are not modules: a head's output is its slice of the input of the attention module's
# output projection (``c_proj`` in GPT-2, ``o_proj`` in Llama, ``dense`` in GPT-NeoX and BERT).
# hookscope finds the projection and the head count itself.
attn = list(hs.blocks(model, "self_attn"))
heads = restored(
    hs.patch_sweep(model, prompts.clean, prompts.corrupted, next_token_logit, attn, over=("head",))
)
print(heads.numpy().round(3))

# %%
# Which heads are induction heads, by their attention pattern alone: from each token of the
# second copy, the attention to the token after its earlier occurrence (eager attention returns
# the probabilities with ``output_attentions=True``).
with torch.no_grad():
    attentions = model(prompts.clean, output_attentions=True).attentions
q = torch.arange(L + 1, 2 * L + 1)
t = torch.arange(1, 2 * L + 1)
induction = torch.stack([a[:, :, q, q - L + 1].mean((0, 2)) for a in attentions])
previous = torch.stack([a[:, :, t, t - 1].mean((0, 2)) for a in attentions])
print("induction score\n", induction.numpy().round(2))
print("previous-token score\n", previous.numpy().round(2))

named = {tuple(s) for s in (induction > 0.5).nonzero().tolist()}
k = len(named)
ranked = {divmod(int(i), heads.shape[1]) for i in heads.flatten().topk(k).indices}
print(f"induction heads by attention: {sorted(named)}; top {k} of the sweep: {sorted(ranked)}")
assert ranked == named

fig, axes = plt.subplots(1, 2, figsize=(8, 2.2))
hs.plot_patching(heads, attn, ax=axes[0], title="restored by one head (share)")
hs.plot_patching(induction, attn, ax=axes[1], title="induction score (attention)")
fig.tight_layout()

# %%
# The previous-token head does not show in that sweep: patched alone into the corrupted run, it
# points the induction heads at a corrupted token. Patching the other way round finds it:
# ``reverse=True`` puts each corrupted head into the clean run (noising), and the share of the
# clean lead it destroys names every head the circuit needs.
noised = hs.patch_sweep(
    model, prompts.clean, prompts.corrupted, next_token_logit, attn, over=("head",), reverse=True
)
destroyed = (clean_value - noised) / (clean_value - corrupt_value)
print(destroyed.numpy().round(3))
prev_head = int(previous[0].argmax())
print(f"layer 0: the head the noising hurts most is {int(destroyed[0].argmax())}; "
      f"the previous-token head by attention is {prev_head}")  # fmt: skip
assert int(destroyed[0].argmax()) == prev_head

fig, ax = plt.subplots(figsize=(5, 2.2))
hs.plot_patching(destroyed, attn, ax=ax, title="destroyed by noising (share)")
fig.tight_layout()

# %%
# Heads by position
# -----------------
# ``over=("position", "head")`` patches one head at one position. The induction heads matter
# where they read: at the second copy, whose tokens look up their earlier occurrence.
by_pos = restored(
    hs.patch_sweep(
        model, prompts.clean, prompts.corrupted, next_token_logit, attn, over=("position", "head")
    )
)
print("head x position:", tuple(by_pos.shape))
fig, ax = plt.subplots(figsize=(9, 3.5))
hs.plot_patching(by_pos, attn, tokens=tokens, ax=ax, title="one head at one position")
fig.tight_layout()

# %%
# Attribution patching
# --------------------
# The exact sweep runs every site. Attribution patching estimates every site's effect,
# ``metric(patched) - metric(corrupted)``, from the gradient at the corrupted run:
# two forwards and one backward in all. ``top_k`` re-runs the largest sites exactly.
scores, exact = hs.attribution_patch(
    model, prompts.clean, prompts.corrupted, next_token_logit, attn, over=("head",), top_k=k
)
estimated = scores / (clean_value - corrupt_value)
corr = float(torch.corrcoef(torch.stack([estimated.flatten(), heads.flatten()]))[0, 1])
print(f"correlation with the exact sweep: {corr:.3f}")
picked = ~exact.isnan()
for (layer, head), est, ex in zip(picked.nonzero().tolist(), scores[picked], exact[picked]):
    print(f"layer {layer} head {head}: estimated {est:+.3f}  exact {ex:+.3f}")
assert {tuple(s) for s in picked.nonzero().tolist()} == named

fig, axes = plt.subplots(1, 2, figsize=(8, 2.2))
hs.plot_patching(heads, attn, ax=axes[0], title="exact (share)")
hs.plot_patching(estimated, attn, ax=axes[1], title="attribution estimate (share)")
fig.tight_layout()

# %%
# Runs that do not align are refused
# ----------------------------------
# Patching copies activations position by position. Prompts padded differently would copy a
# padding position into a word (nnsight #672); hookscope names the positions instead.
ones = torch.ones_like(prompts.clean)
short = {"input_ids": prompts.corrupted, "attention_mask": ones.clone()}
short["attention_mask"][1, :2] = 0
try:
    hs.patch_sweep(model, {"input_ids": prompts.clean, "attention_mask": ones},
                   short, next_token_logit, hs.blocks(model))  # fmt: skip
except hs.PatchingError as e:
    print(e)
