"""
Pictures of activations
=======================

:func:`hookscope.feature_maps` draws one sample's activation as a grid of channel maps (the
channels with the most energy first, each scaled to its own range), so you can see what each
stage of a network responds to. It returns a matplotlib figure; ``fig.savefig("maps.png")``
writes it.
"""

# %%
from PIL import Image

import hookscope as hs

model = hs.load_demo_model()
data = hs.make_demo_dataset(8, seed=5)
i = int((data.labels == data.classes.index("triangle")).nonzero()[0])
x = data.images[i : i + 1]
picture = Image.fromarray((x[0].permute(1, 2, 0) * 255).byte().numpy()).resize((192, 192))
print("class:", data.classes[data.labels[i]], "| predicted:", model.classes[model(x).argmax()])

# %%
# Capture the three stages
# ------------------------
with hs.capture(model, ["stage1", "stage2", "stage3"]) as cap:
    model(x)
print({k: tuple(v.shape) for k, v in cap.items()})

# %%
# The first stage: edges and colour contrasts, at half the input's resolution.
stage1_maps = hs.feature_maps(cap["stage1"][0], max_channels=16)

# %%
# The last stage: 64 channels at 16×16, the ones with the most energy first.
stage3_maps = hs.feature_maps(cap["stage3"][0], max_channels=16)

# %%
# ``normalize="global"`` puts every map on one scale, so you compare strengths across
# channels; ``order="index"`` shows the first channels in order instead.
stage3_global = hs.feature_maps(cap["stage3"][0], max_channels=8, order="index", normalize="global")

# %%
# Which channels matter for the prediction?
# -----------------------------------------
# The energy order shows what is *active*. To see what the class score *depends on*, weight
# each channel by the gradient of the score (this is what Grad-CAM averages; see the Grad-CAM
# tutorial) and show the channels with the largest contribution.
pred = int(model(x).argmax())
with hs.capture(model, "stage3", grads=True) as cap:
    model(x)[0, pred].backward()
model.zero_grad()
contribution = (cap["stage3"][0] * cap.grads["stage3"][0]).sum((1, 2))
top = contribution.topk(8).indices
print("channels that raise the score most:", top.tolist())
top_maps = hs.feature_maps(cap["stage3"][0][top], max_channels=8, order="index")
