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

The model here is a small GPT-2 with random weights and a made-up vocabulary, so the words it
generates mean nothing; the numbers are real.
"""

# %%
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hookscope as hs

torch.manual_seed(0)
WORDS = ["<pad>", "<unk>", "<eos>", "the", "a", "cat", "dog", "went", "to", "park", "store"]
WORDS += ["love", "hate", "good", "bad", "happy", "sad", "i", "you", "we", "very"]
config = GPT2Config(
    vocab_size=len(WORDS), n_positions=64, n_embd=64, n_layer=4, n_head=4,
    bos_token_id=2, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
)  # fmt: skip
model = GPT2LMHeadModel(config).eval()


def encode(texts: list[str]) -> dict[str, torch.Tensor]:
    """Token ids, left-padded (what generate wants), and the attention mask."""
    ids = [[WORDS.index(w) for w in t.split()] for t in texts]
    width = max(map(len, ids))
    pad = [[0] * (width - len(r)) for r in ids]
    return {
        "input_ids": torch.tensor([p + r for p, r in zip(pad, ids)]),
        "attention_mask": torch.tensor([[0] * len(p) + [1] * len(r) for p, r in zip(pad, ids)]),
    }


def decode(ids: torch.Tensor) -> str:
    return " ".join(WORDS[i] for i in ids.tolist() if i >= 0)


prompts = encode(["the cat went to the park", "i love you"])
print(prompts["input_ids"])

# %%
# Capture a generated sequence
# ----------------------------
# Inside the ``with``, ``generate`` calls each block on the 6-token prompt, then 7 times on one
# token. ``cap.calls`` keeps those ragged calls; ``cap.sequence`` puts them together.
with hs.capture(model, ["transformer.h.1", "transformer.h.3"], sequence=True) as cap:
    out = model.generate(**prompts, max_new_tokens=8, do_sample=False)
print("calls:", [tuple(c.output.shape) for c in cap.calls("transformer.h.3")][:3], "...")
seq = cap.sequence("transformer.h.3")
print("values", tuple(seq.values.shape), "mask per row", seq.mask.sum(1).tolist())
for b in range(2):
    print(f"row {b}:", decode(seq.tokens[b][seq.mask[b]]))

# %%
# The second row's prompt was left-padded by 3; in ``seq`` its tokens start at position 0 like
# the first row's, and the mask ends it 3 positions earlier. The values are those of one forward
# over the final sequence (the last generated token never ran through the model):
ids = out[:, :-1]
mask = torch.cat([prompts["attention_mask"], torch.ones(2, 7, dtype=torch.long)], 1)
with hs.capture(model, "transformer.h.3") as ref:
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
for b in range(2):
    n = int(seq.mask[b].sum())
    diff = (seq.values[b, :n] - ref["transformer.h.3"][b][mask[b].bool()]).abs().max()
    print(f"row {b}: max difference to one full forward {float(diff):.1e}")

# %%
# A steering vector
# -----------------
# The mean difference of block 1's output at the last token between positive and negative
# prompts of different lengths: one forward for all pairs (padded on the right).
positive = [encode([t])["input_ids"][0] for t in ["i love you", "very good", "we love the dog"]]
negative = [encode([t])["input_ids"][0] for t in ["i hate you", "very bad", "we hate the dog"]]
vec = hs.steering_vector(model, positive, negative, "transformer.h.1")
print({k: (tuple(v.shape), round(float(v.norm()), 3)) for k, v in vec.items()})

# %%
# Steer the generation
# --------------------
# Add the vector, scaled, to block 1's output at the generated tokens only, and compare.
# ``positions`` may also be ``"all"``, ``"prompt"``, an int ``k`` (positions ``k`` and later) or
# a per-row bool mask; ``mode="ablate"`` projects the direction out instead.
for scale in (0.0, 4.0, 8.0):
    with hs.steer(model, vec, scale=scale, positions="generated"):
        steered = model.generate(**prompts, max_new_tokens=8, do_sample=False)
    print(f"scale {scale}:", " | ".join(decode(r[-8:]) for r in steered))

# %%
# How far did steering move the last block's output? Capture it while steering.
with (
    hs.steer(model, vec, scale=8.0, positions="generated"),
    hs.capture(model, "transformer.h.3", sequence=True) as cap2,
):
    model.generate(**prompts, max_new_tokens=8, do_sample=False)
moved = cap2.sequence("transformer.h.3")
same = (moved.tokens == seq.tokens).all(1)
unchanged = torch.allclose(moved.values[:, :3], seq.values[:, :3], atol=1e-6)
print("prompt positions unchanged:", unchanged)
print("rows whose tokens changed:", (~same).nonzero().flatten().tolist())
print("hooks left on the model:", hs.hooks_on(model))
