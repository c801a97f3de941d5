"""
Language models: capture a generation, build a steering vector, steer
=====================================================================

``model.generate()`` runs every layer once on the prompt, then once per new token on a single
position (the KV cache), with left-padded rows in a batch. hookscope turns that into one tensor
per layer, aligned token by token, and steers generation by adding a direction to a layer's
hidden states:

* ``hs.capture(model, layers, sequence=True)`` and ``cap.sequence(layer)``: values, a mask and
  the token ids for the prompt and every generated token;
* ``hs.steering_vector(model, positive, negative, layers)``: the mean difference of a layer's
  output between contrastive prompts;
* ``hs.steer(model, {layer: vector}, scale=..., positions=...)``: add it (or project it out)
  during ``generate``.

The model is hookscope's demo language model (:func:`hookscope.load_demo_lm`), a two-layer Llama
whose induction heads continue any span of tokens that repeats: after ``a b c d ... a b`` it
writes ``c d ...``. Its tokens are ids without text (``0`` begins every prompt).
"""

# %%
import torch

import hookscope as hs

torch.set_num_threads(1)
model = hs.load_demo_lm()
spans = hs.make_induction_prompts(2, 10, seed=4).clean[:, 1:11]  # two spans of 10 tokens


def encode(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Token ids, left-padded (what generate wants), and the attention mask."""
    width = max(map(len, rows))
    pad = [[0] * (width - len(r)) for r in rows]
    return {
        "input_ids": torch.tensor([p + r for p, r in zip(pad, rows)]),
        "attention_mask": torch.tensor([[0] * len(p) + [1] * len(r) for p, r in zip(pad, rows)]),
    }


# row 0: a span and the start of its repeat; row 1: a shorter span (padded on the left)
a, b = spans[0].tolist(), spans[1, :6].tolist()
prompts = encode([[0, *a, *a[:3]], [0, *b, *b[:2]]])
print(prompts["input_ids"])

# %%
# Capture a generated sequence
# ----------------------------
# Inside the ``with``, ``generate`` calls each block on the 14-token prompt, then 5 times on one
# token. ``cap.calls`` keeps those ragged calls; ``cap.sequence`` puts them together.
gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
with hs.capture(model, ["model.layers.0", "model.layers.1"], sequence=True) as cap:
    out = model.generate(**prompts, **gen)
print("calls:", [tuple(c.output.shape) for c in cap.calls("model.layers.1")][:3], "...")
seq = cap.sequence("model.layers.1")
print("values", tuple(seq.values.shape), "mask per row", seq.mask.sum(1).tolist())
for row in range(2):
    print(f"row {row}:", seq.tokens[row][seq.mask[row]].tolist())

# %%
# The model continues each span where its repeat stopped:
print("generated:", out[:, -6:].tolist())
assert out[0, -6:].tolist() == a[3:9]
assert out[1, -6:].tolist() == (b * 2)[2:8]

# %%
# The second row's prompt was left-padded; in ``seq`` its tokens start at position 0 like the
# first row's, and the mask ends it as many positions earlier. The values are those of one
# forward over the final sequence (the last generated token never ran through the model):
padding = int((prompts["attention_mask"][1] == 0).sum())
print(
    f"row 1: {padding} padding positions; mask ends {int(seq.mask[0].sum() - seq.mask[1].sum())} earlier"
)
ids = out[:, :-1]
mask = torch.cat([prompts["attention_mask"], torch.ones(2, 5, dtype=torch.long)], 1)
with hs.capture(model, "model.layers.1") as ref:
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
for row in range(2):
    n = int(seq.mask[row].sum())
    diff = (seq.values[row, :n] - ref["model.layers.1"][row][mask[row].bool()]).abs().max()
    print(f"row {row}: max difference to one full forward {float(diff):.1e}")

# %%
# A steering vector that moves the induction heads
# ------------------------------------------------
# The layer-1 induction heads look up the *current* token, as layer 0 left it, in the earlier
# copy. A steering vector from contrastive prompts that differ only in their last token,
# ``x`` against ``y``, is the difference layer 0 writes for ``x`` rather than ``y``. Added at
# the last prompt position (where the token is ``y``), it should make the heads look up ``x``
# instead, so that the model jumps to the token after ``x``'s earlier occurrence.
x, y = a[7], a[2]  # row 0's prompt ends with a[2]; a[7] comes later in its span
contexts = hs.make_induction_prompts(24, 10, seed=5).clean[:, :14]
contexts = contexts[(contexts != x).all(1) & (contexts != y).all(1)]
positive = [torch.cat([c[:-1], torch.tensor([x])]) for c in contexts]
negative = [torch.cat([c[:-1], torch.tensor([y])]) for c in contexts]
vec = hs.steering_vector(model, positive, negative, "model.layers.0")
print(
    f"{len(positive)} pairs:",
    {k: (tuple(v.shape), round(float(v.norm()), 3)) for k, v in vec.items()},
)

# %%
# Steer the generation
# --------------------
# ``positions`` selects the tokens to steer: ``"all"``, ``"prompt"``, ``"generated"``, an int
# ``k`` (positions ``k`` and later) or a per-row bool mask, as here: row 0's last prompt
# token only. ``mode="ablate"`` projects the direction out instead.
last = torch.zeros(1, 14, dtype=torch.bool)
last[0, -1] = True
row0 = {k: v[:1] for k, v in prompts.items()}
for scale in (0.0, 0.5, 1.0, 2.0):
    with hs.steer(model, vec, scale=scale, positions=last):
        steered = model.generate(**row0, **gen)
    print(f"scale {scale}:", steered[0, -6:].tolist())
print("span:", a)

# %%
# Unsteered, the model writes ``a[3] a[4] ...``; steered at scale 1 it writes ``a[8] a[9]``, the
# tokens after ``x = a[7]``, then goes on from there: once the generated token is itself in the
# span, the induction heads follow it without help.
with hs.steer(model, vec, scale=1.0, positions=last):
    steered = model.generate(**row0, **gen)
assert steered[0, -6:-4].tolist() == a[8:10]

# %%
# Did steering move anything else? Capture while steering: the positions before the steered one
# are unchanged (the model is causal), and no hook is left behind.
with (
    hs.steer(model, vec, scale=1.0, positions=last),
    hs.capture(model, "model.layers.1", sequence=True) as cap2,
):
    model.generate(**row0, **gen)
moved = cap2.sequence("model.layers.1")
unchanged = torch.allclose(moved.values[0, :13], seq.values[0, :13], atol=1e-5)
print("positions before the steered token unchanged:", unchanged)
print("hooks left on the model:", hs.hooks_on(model))
