"""
Pull features out: ``capture``, ``FeatureExtractor``, ``extract``
=================================================================

Three tools for intermediate values, from a quick look to a whole data set on disk:

* :func:`hookscope.capture`: a ``with`` block that records the outputs (and, if asked, the
  inputs and gradients) of the layers you name, every call;
* :class:`hookscope.FeatureExtractor`: an ``nn.Module`` that returns ``{layer: output}`` and
  stops the forward pass once it has them;
* :func:`hookscope.extract`: a whole data set through the model, each layer's features written
  to a memory-mapped ``.npy`` file, resumable.
"""

# %%
import tempfile

import torch
import torch.nn.functional as F

import hookscope as hs

torch.manual_seed(0)
model = hs.load_demo_model()
data = hs.make_demo_dataset(64, seed=3)
x, y = data.images[:8], data.labels[:8]

# %%
# Capture outputs and gradients
# -----------------------------
# ``cap[name]`` is the output of the last call (a detached copy: what the layer returned, even
# if the model changes it in place afterwards), ``cap.grads[name]`` the gradient with respect to
# it, ``cap.calls(name)`` every call.
with hs.capture(model, ["stage2", "stage3", "head.2"], grads=True) as cap:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
model.zero_grad()

print({k: tuple(v.shape) for k, v in cap.items()})
print("grad of stage3:", tuple(cap.grads["stage3"].shape))
print("logits equal the model's output:", torch.allclose(cap["head.2"], model(x)))

# %%
# Inputs too, with ``inputs=True``: ``cap.inputs[name]`` holds the positional and keyword
# arguments of the call.
with hs.capture(model, "head.2", inputs=True) as cap:
    model(x)
print(tuple(cap.inputs["head.2"].args[0].shape))

# %%
# Stopping early
# --------------
# ``stop=True`` ends the forward pass once every selected layer has run: hookscope raises
# inside the model and the ``with`` block catches it at its end. So **the rest of the block is
# skipped**: code after the model call does not run, and the call's result is never assigned.
# ``cap.stopped`` tells you it happened.
out = None
with hs.capture(model, "stage1", stop=True) as cap:
    out = model(x)
    print("never printed")
print("stopped:", cap.stopped, "| out is", out, "| stage1:", tuple(cap["stage1"].shape))

# %%
# When you want the early exit *and* code that carries on normally, use a
# :class:`~hookscope.FeatureExtractor`: its call returns the features.
fx = hs.FeatureExtractor(model, ["stage1", "stage3"])
feats = fx(x)
print({k: tuple(v.shape) for k, v in feats.items()})

# %%
# A linear probe on pooled features
# ---------------------------------
# ``FeatureExtractor`` keeps the graph (``detach=False`` by default), so you could train through
# it; here we only need the values. A logistic regression on each stage's pooled channels:
# how readable is the class after the first stage, and after the last?
fx = hs.FeatureExtractor(model, ["stage1", "stage3"], detach=True)
with torch.no_grad():
    f = fx(data.images)
for layer in ("stage1", "stage3"):
    z = f[layer].mean((2, 3))
    z = (z - z.mean(0)) / (z.std(0) + 1e-6)
    probe = torch.nn.Linear(z.shape[1], 4)
    opt = torch.optim.LBFGS(probe.parameters(), max_iter=100)

    def closure(probe=probe, z=z, opt=opt):
        opt.zero_grad()
        loss = F.cross_entropy(probe(z), data.labels)
        loss.backward()
        return loss

    opt.step(closure)
    acc = (probe(z).argmax(1) == data.labels).float().mean()
    print(f"{layer}: probe accuracy on its training set {acc:.2f}")

# %%
# A whole data set to disk
# ------------------------
# :func:`hookscope.extract` writes one ``.npy`` per layer (``pool="avg"`` averages the spatial
# dimensions), an index and a manifest written last. Run it again after an interruption and it
# continues where it stopped.
out_dir = tempfile.mkdtemp()
feats = hs.extract(
    model, data, ["stage3", "head.2"], out_dir, pool="avg", batch_size=16, progress=False
)
print(feats)
print(feats["stage3"].shape, feats.index[:5])

# %%
# Later, or in another process:
again = hs.load_features(out_dir)
print(bool((again["head.2"] == feats["head.2"]).all()))
