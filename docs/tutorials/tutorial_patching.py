"""
Activation patching: layers, positions and heads in a few batched passes
========================================================================

Activation patching asks *where* a model computes something. Run a clean prompt and a
corrupted one that differs in a key detail, copy one activation of the clean run into the
corrupted run, and measure how much of the clean answer comes back. Done for every layer,
position and attention head, this maps the sites that matter:

* ``hs.patch_sweep(model, clean, corrupt, metric, layers, over=...)``: the metric after each
  patch, shaped ``[layers, *over]``; heads are found under any Hugging Face attention module;
* ``hs.attribution_patch(...)``: a first-order estimate of the same sweep from two forwards
  and one backward;
* ``hs.plot_patching(...)``: a heat map with the layer names and the tokens.

The model here is a small GPT-2 with random weights and a made-up vocabulary (the IOI task's
shape, "when Mary and John went to the store, John gave a bag to" -> Mary), so the circuit it
shows means nothing; the numbers are real.
"""

# %%
import matplotlib.pyplot as plt
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hookscope as hs

torch.manual_seed(0)
torch.set_num_threads(1)
WORDS = [
    "<pad>",
    "when",
    "mary",
    "and",
    "john",
    "alice",
    "bob",
    "went",
    "to",
    "the",
    "store",
    "park",
    "gave",
    "a",
    "bag",
    "ball",
]
config = GPT2Config(
    vocab_size=len(WORDS), n_positions=64, n_embd=64, n_layer=4, n_head=4,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager",
)  # fmt: skip
model = GPT2LMHeadModel(config).eval()


def encode(*texts: str) -> torch.Tensor:
    return torch.tensor([[WORDS.index(w) for w in t.split()] for t in texts])


clean = encode(
    "when mary and john went to the store john gave a bag to",
    "when alice and bob went to the park bob gave a ball to",
)
corrupt = encode(  # the second name (S2) swapped: the answer should flip
    "when mary and john went to the store mary gave a bag to",
    "when alice and bob went to the park alice gave a ball to",
)
answer = torch.tensor([WORDS.index("mary"), WORDS.index("alice")])
wrong = torch.tensor([WORDS.index("john"), WORDS.index("bob")])


def logit_diff(out) -> torch.Tensor:
    """Correct minus wrong name at the last position, averaged over the batch."""
    last = out.logits[:, -1]
    return (last.gather(1, answer[:, None]) - last.gather(1, wrong[:, None])).mean()


with torch.no_grad():
    print(f"clean {logit_diff(model(clean)):.4f}  corrupted {logit_diff(model(corrupt)):.4f}")

# %%
# Which layers to sweep
# ---------------------
# A glob's ``*`` spans dots, so ``"transformer.h.*"`` selects every module *under* the blocks.
# ``hs.blocks`` finds the repeated blocks, and a child of each.
print(len(hs.find(model, "transformer.h.*")), "modules under the blocks")
print(list(hs.blocks(model)))
print(list(hs.blocks(model, "attn")))

# %%
# The residual stream, layer by position
# --------------------------------------
# ``at="input"`` patches each block's hidden-state input (TransformerLens's ``resid_pre``).
# Positions before the swapped name hold the same values in both runs (the model is causal),
# so those sites are not run: their value is the corrupted run's metric.
resid = hs.patch_sweep(model, clean, corrupt, logit_diff, hs.blocks(model), at="input")
print(resid.shape)
print(resid[:, 7:].numpy().round(4))

fig, ax = plt.subplots(figsize=(8, 3))
tokens = [WORDS[i] for i in clean[0]]
hs.plot_patching(resid, list(hs.blocks(model)), tokens=tokens, ax=ax, title="resid_pre patching")
fig.tight_layout()

# %%
# Attention heads
# ---------------
# Heads are not modules: a head's output is its slice of the input of the attention module's
# output projection (``c_proj`` in GPT-2, ``o_proj`` in Llama, ``dense`` in GPT-NeoX and BERT).
# hookscope finds the projection and the head count itself.
heads = hs.patch_sweep(model, clean, corrupt, logit_diff, hs.blocks(model, "attn"), over=("head",))
by_pos = hs.patch_sweep(
    model, clean, corrupt, logit_diff, hs.blocks(model, "attn"), over=("position", "head")
)
print(heads.numpy().round(4))
print("head x position:", tuple(by_pos.shape))

fig, ax = plt.subplots(figsize=(4, 3))
hs.plot_patching(heads, list(hs.blocks(model, "attn")), ax=ax, title="one head, all positions")
fig.tight_layout()

# %%
# Attribution patching
# --------------------
# The exact sweep runs every site. Attribution patching estimates every site's effect,
# ``metric(patched) - metric(corrupted)``, from the gradient at the corrupted run:
# two forwards and one backward in all. ``top_k`` re-runs the largest sites exactly.
with torch.no_grad():
    base = logit_diff(model(corrupt))
scores, exact = hs.attribution_patch(
    model, clean, corrupt, logit_diff, hs.blocks(model, "attn"), over=("head",), top_k=4
)
effect = heads - base
print("correlation with the exact effect:", float(torch.corrcoef(torch.stack([scores.flatten(), effect.flatten()]))[0, 1]))  # fmt: skip
picked = ~exact.isnan()
for (layer, head), est, ex in zip(picked.nonzero().tolist(), scores[picked], exact[picked]):
    print(f"layer {layer} head {head}: estimated {est:+.4f}  exact {ex:+.4f}")

# %%
# Runs that do not align are refused
# ----------------------------------
# Patching copies activations position by position. Prompts padded differently would copy a
# padding position into a word (nnsight #672); hookscope names the positions instead.
short = {"input_ids": corrupt, "attention_mask": torch.ones_like(corrupt)}
short["attention_mask"][1, :2] = 0
try:
    hs.patch_sweep(model, {"input_ids": clean, "attention_mask": torch.ones_like(clean)},
                   short, logit_diff, hs.blocks(model))  # fmt: skip
except hs.PatchingError as e:
    print(e)
