"""
Training memory per layer, and a checkpointing plan that fits a budget
======================================================================

Most of a training step's memory is the activations layers keep for backward. This tutorial
measures them per layer on a ResNet-18 with :func:`hookscope.memory_profile`, asks for the layers
to checkpoint so that they fit a budget (``profile.plan``), applies the plan with
:func:`hookscope.apply_checkpointing`, and checks that the memory dropped by what was predicted
while the loss and the gradients stayed the same. It runs on a CPU in a few seconds.
"""

# %%
# Profile one training step
# -------------------------
# ``memory_profile`` runs one forward and backward (the loss is the sum of the output unless a
# ``loss_fn`` is given) and charges every tensor autograd saves to the module whose own operation
# saved it. The model is left as found: its ``.grad`` and BatchNorm statistics are put back.
import torch
import torchvision

import hookscope as hs

torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10)
x = torch.randn(4, 3, 64, 64)

prof = hs.memory_profile(model, x)
print(prof.to_text(depth=1))

# %%
# The rows are data: ``saved_bytes`` for a module's own operations, ``saved_bytes_total`` with
# its children, and the totals of the run. Bytes are in binary units everywhere in hookscope
# (KiB, MiB, GiB; ``MiB = 2**20`` bytes), as in the table above.
MiB = 2**20
print(f"saved for backward in all: {prof.total_saved_bytes / MiB:.2f} MiB")
for name in ["layer1", "layer2", "layer3", "layer4"]:
    row = prof[name]
    print(
        f"{name}: saves {row.saved_bytes_total / MiB:.2f} MiB, {row.flops_total / 1e6:.0f} MFLOPs"
    )

# %%
# A bar chart per layer (matplotlib is imported only here).
fig = prof.plot(depth=1)

# %%
# What checkpointing a layer frees is not what it saves
# -----------------------------------------------------
# Checkpointing ``layer1`` drops what it saves inside, but its output stays saved by ``layer2``
# and the checkpoint keeps its input. The plan knows this: it predicts from the recorded saves.
budget = int(prof.total_saved_bytes * 0.6)
plan = prof.plan(budget)
print(plan)
print(f"predicted drop: {plan.predicted_drop / MiB:.2f} MiB")

# %%
# Apply the plan and measure
# --------------------------
# ``apply_checkpointing`` wraps the named modules in non-reentrant ``torch.utils.checkpoint``
# (their names, parameters and hooks unchanged); the handle undoes it at the end of the block.
model.zero_grad()
loss_before = model(x).sum()
loss_before.backward()
grads_before = [p.grad.clone() for p in model.parameters()]

with hs.apply_checkpointing(model, plan):
    after = hs.memory_profile(model, x)
    model.zero_grad()
    loss_after = model(x).sum()
    loss_after.backward()

measured = prof.total_saved_bytes - after.total_saved_bytes
print(f"measured drop: {measured / MiB:.2f} MiB (predicted {plan.predicted_drop / MiB:.2f} MiB)")
same_grads = all(
    torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), grads_before)
)
print(
    f"loss unchanged: {torch.allclose(loss_before, loss_after)}; gradients unchanged: {same_grads}"
)

# %%
# Hooks under checkpointing
# -------------------------
# A checkpointed layer runs its forward again in backward. hookscope's hooks count that as the
# same call: a capture of gradients sees one call per layer, with the gradient of the run
# without checkpointing, also under reentrant checkpointing (whose first forward has no grad).
layers = ["layer2.0.conv1", "layer3"]
with (
    hs.apply_checkpointing(model, ["layer2", "layer3"], kind="reentrant"),
    hs.capture(model, layers, grads=True) as cap,
):
    model(x).sum().backward()
print({name: len(cap.calls(name)) for name in cap.layers})
print(f"gradient norm at layer3: {cap.grads['layer3'].norm():.4f}")
