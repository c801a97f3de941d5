"""
Change activations and gradients
================================

hookscope changes values *inside* a model for the duration of a ``with`` block, and puts the
model back as it was afterwards:

* :func:`hookscope.edit` changes a layer's output (or input): zero it, scale it, add to it,
  ablate channels, replace it, or apply any function;
* :func:`hookscope.edit_grads` changes the gradient flowing out of a layer, or a parameter's
  gradient before it is accumulated;
* :func:`hookscope.clip_grads` clips per parameter until you remove it;
* :func:`hookscope.tensor_grads` and :func:`hookscope.observe` read gradients and calls without
  changing anything.

The ready-made operations are in :mod:`hookscope.ops`.
"""

# %%
import torch
import torch.nn.functional as F

import hookscope as hs

torch.manual_seed(0)
model = hs.load_demo_model()
data = hs.make_demo_dataset(96, seed=11)


def accuracy() -> float:
    with torch.no_grad():
        return float((model(data.images).argmax(1) == data.labels).float().mean())


print(f"accuracy: {accuracy():.3f}")

# %%
# Ablate channels
# ---------------
# Which of ``stage3``'s 64 channels does the classifier need? Zero the ``k`` channels that are
# most active on average, and for comparison the ``k`` least active ones. The edit lives only
# inside the ``with``. (On this model no small set of channels matters much: the evidence is
# spread over many.)
with torch.no_grad(), hs.capture(model, "stage3") as cap:
    model(data.images)
order = cap["stage3"].mean((0, 2, 3)).argsort(descending=True).tolist()
for k in (4, 8, 16, 32):
    with hs.edit(model, {"stage3": hs.ops.ablate(order[:k])}):
        top = accuracy()
    with hs.edit(model, {"stage3": hs.ops.ablate(order[-k:])}):
        bottom = accuracy()
    print(f"{k:2d} channels ablated: most active -> {top:.3f}, least active -> {bottom:.3f}")
print(f"after the edits: {accuracy():.3f}")

# %%
# Other edits: scale an output, add noise to an input (``at="input"``), or any function of the
# value. Edits apply to every tensor of a nested value and never change it in place.
with hs.edit(model, {"stage2": hs.ops.scale(0.5)}):
    print(f"stage2 halved: {accuracy():.3f}")
with hs.edit(model, {"stage1.1": lambda t: t + 0.3 * torch.randn_like(t)}, at="input"):
    print(f"noise into stage1's first conv: {accuracy():.3f}")

# %%
# Gradients of any layer
# ----------------------
# Clamp the gradient that flows back out of ``stage3`` at zero (only positive evidence
# reaches the earlier layers) and zero the gradient of the classifier's bias. We check the
# result against plain autograd.
x, y = data.images[:16], data.labels[:16]
with hs.edit_grads(model, {"stage3": hs.ops.clamp(min=0), "head.2.bias": hs.ops.zero()}):
    F.cross_entropy(model(x), y).backward()
edited = model.stage2[0].weight.grad.clone()
print("head.2.bias grad:", model.head[2].bias.grad)
model.zero_grad()

h2 = model.stage2(model.stage1(x))
h3 = model.stage3(h2)
g3 = torch.autograd.grad(F.cross_entropy(model.head(h3), y), h3)[0]
(ref,) = torch.autograd.grad(h3, model.stage2[0].weight, grad_outputs=g3.clamp(min=0))
print("equals autograd with the clamped gradient:", torch.allclose(edited, ref, atol=1e-6))

# %%
# Clip every parameter's gradient until the handle is removed (here a gradient norm of 0.1
# per parameter):
handle = hs.clip_grads(model, max_norm=0.1)
F.cross_entropy(model(x), y).backward()
print(max(float(p.grad.norm()) for p in model.parameters()))
handle.remove()
model.zero_grad()

# %%
# Reading without changing
# ------------------------
# :func:`hookscope.tensor_grads` collects gradients of any tensors, intermediate ones too,
# without ``retain_grad()``; :func:`hookscope.observe` calls a function after each call of a
# layer.
logits = model(x)
probs = logits.softmax(1)
with hs.tensor_grads(logits, probs) as g:
    probs[:, 0].sum().backward()
print(tuple(g[0].shape), float(g[1][:, 0].sum()))
model.zero_grad()

seen = []
with (
    torch.no_grad(),
    hs.observe(
        model,
        ["stage1", "stage2", "stage3"],
        lambda call: seen.append((call.layer, float(call.output.std()))),
    ),
):
    model(x)
print(seen)
