"""
Debug a training run: ``Monitor``, the sentinel, trainer callbacks
==================================================================

:class:`hookscope.Monitor` watches a training loop: per-layer activation and output-gradient
statistics, per-parameter gradient and weight norms and update ratios, alerts for vanishing or
exploding gradients, dead units and saturation, and (with ``sentinel=True``) the first layer
that produced a NaN or an Inf. Call ``mon.step(optimizer)`` once per optimizer step, after
``optimizer.step()`` and before ``zero_grad()``.
"""

# %%
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs

torch.manual_seed(0)
data = hs.make_demo_dataset(128, seed=2)
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)

# %%
# A healthy run
# -------------
# A fresh (narrow) demo CNN trained for one epoch of 8 steps, logged every 2 steps. Records
# stay in ``mon.records``; sinks (TensorBoard, JSON Lines, W&B, MLflow or any callable) get
# each one.
model = hs.DemoNet(width=8)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
with hs.Monitor(model, every=2) as mon:
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        mon.step(opt)
        opt.zero_grad()
rec = mon.records[-1]
print(len(mon.records), "records; step", rec.step)
print("stage3.3:", {k: round(v, 4) for k, v in rec.layers["stage3.3"].items()})
print("head.2.weight:", {k: round(v, 5) for k, v in rec.params["head.2.weight"].items()})
print("alerts:", [a.message for r in mon.records for a in r.alerts] or "none")

# %%
# The gradient flow: the norm of each parameter's gradient, mean and max over the records.
grad_flow = hs.plot_grad_flow(mon.records)

# %%
# A run that goes wrong
# ---------------------
# A deep stack of sigmoids with a small initialisation: each layer shrinks the gradient, so it
# vanishes towards the first layers, and the monitor says so, naming the layers.
deep = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(32, 32), nn.Sigmoid())])
for m in deep:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)
opt = torch.optim.SGD(deep.parameters(), lr=0.1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with hs.Monitor(deep, every=1) as mon:
        for _ in range(3):
            deep(torch.randn(64, 32)).pow(2).mean().backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
kinds = sorted({a.kind for r in mon.records for a in r.alerts})
print("alert kinds:", kinds)
print(mon.records[-1].alerts[0].message)
print(len(caught), "MonitorWarnings were issued (alerts='warn' is the default)")

# %%
# Where did the first NaN come from?
# ----------------------------------
# A copy of the demo CNN with one BatchNorm broken (a negative running variance makes its
# output NaN). :func:`hookscope.find_nonfinite` runs one forward and backward pass and names
# the layer that produced the first NaN/Inf, and the phase.
broken = hs.load_demo_model()
with torch.no_grad():
    broken.stage2[4].running_var[3] = -1.0
x, y = data.images[:8], data.labels[:8]
origin = hs.find_nonfinite(broken, x, loss_fn=lambda out: F.cross_entropy(out, y))
print(origin)

# %%
# During training, ``sentinel=True`` checks every layer on every step and reports the first
# NaN/Inf in ``record.nonfinite``, with a :class:`~hookscope.NonFiniteWarning`.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with hs.Monitor(broken, every=1, sentinel=True) as mon:
        F.cross_entropy(broken(x), y).backward()
        mon.step()
print(mon.records[0].nonfinite)
first = next(w for w in caught if isinstance(w.message, hs.NonFiniteWarning))
print(type(first.message).__name__, "|", str(first.message)[:120])

# %%
# Inside a trainer
# ----------------
# The callbacks own a Monitor, step it at the right moment (once per optimizer step, with
# gradient accumulation too), leave validation passes out and send each record to the
# trainer's loggers. PyTorch Lightning, for 4 optimizer steps of 2 micro-batches each:
import lightning as L  # noqa: E402

from hookscope.integrations.lightning import HookscopeCallback  # noqa: E402


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = hs.DemoNet(width=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


callback = HookscopeCallback(every=2, alerts="off")
trainer = L.Trainer(
    max_epochs=1,
    max_steps=4,
    accumulate_grad_batches=2,
    callbacks=[callback],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Lightning's advice about DataLoader workers
    trainer.fit(Module(), loader)
print([r.step for r in callback.records])
print(sorted(callback.records[-1].layers)[:4])

# %%
# The Hugging Face ``Trainer`` takes
# :class:`~hookscope.integrations.transformers.HookscopeTrainerCallback` the same way::
#
#     from hookscope.integrations.transformers import HookscopeTrainerCallback
#     args = TrainingArguments("out", gradient_accumulation_steps=4)
#     trainer = Trainer(model=model, args=args, train_dataset=data)
#     trainer.add_callback(HookscopeTrainerCallback(trainer, every=10))
#     trainer.train()
#
# and with Accelerate, call ``mon.step(optimizer)`` when ``accelerator.sync_gradients`` is true.
