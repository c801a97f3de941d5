"""
Compiled and sharded models
===========================

hookscope works on the models people train at scale, with the eager model's layer names and
values:

* a ``torch.compile``'d model (the wrapper, ``model.compile()`` in place, or compiled parts):
  hand hookscope the object you call;
* FSDP2 (``fully_shard``) and tensor-parallel models whose parameters are ``DTensor`` shards:
  gradient edits, clipping and the monitor see the full tensors.

This page runs both on the CPU. The compile uses the ``eager`` backend (Dynamo only) to keep the page
quick; ``inductor`` (the default) works the same way. The sharding runs in this one process as
a one-rank ``gloo`` group, which is enough to show the ``DTensor`` machinery; launch the same
code with ``torchrun --nproc-per-node N`` for real sharding (``examples/train_distributed.py``).
"""

# %%
import copy
import time

import torch
import torch.nn.functional as F

import hookscope as hs

torch.manual_seed(0)
model = hs.load_demo_model()
x = hs.make_demo_dataset(16, seed=9).images

# %%
# A compiled model
# ----------------
cm = torch.compile(model, backend="eager")
with torch.no_grad():
    cm(x)  # compiles once, without hooks

with hs.capture(cm, ["stage2", "stage3"]) as cap:  # names without "_orig_mod."
    out = cm(x)
with hs.capture(model, ["stage2", "stage3"]) as ref:  # the same weights, eagerly
    model(x)
print(list(cap))
print(
    "equal to eager:",
    all(torch.allclose(cap[k], ref[k], atol=1e-5) for k in ref),
)

# %%
# While a scope holds hooks inside the compiled model, its calls run a *hooked variant*
# (compiled once per set of hooked layers, with graph breaks at the hooked layers only); calls
# without a scope run your own compiled graph, untouched. The second scope on the same layers
# compiles nothing:
t0 = time.perf_counter()
with hs.capture(cm, ["stage2", "stage3"]) as cap:
    cm(x)
print(f"second capture: {time.perf_counter() - t0:.3f} s")

# %%
# Gradients, edits and Grad-CAM work too, with the same values as the eager model:
cam = hs.GradCAM(cm, "stage3")(x[:4])
print(tuple(cam.shape), torch.allclose(cam, hs.GradCAM(model, "stage3")(x[:4]), atol=1e-4))

# %%
# A sharded model (FSDP2, one rank)
# ---------------------------------
import os  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
plain = copy.deepcopy(net)  # the same weights, unsharded, to compare with
fully_shard(net[0], mesh=mesh)
fully_shard(net, mesh=mesh)
print(type(net[0].weight).__name__, "shards of", tuple(net[0].weight.shape))

# %%
# ``clip_grads(max_norm=...)`` clips each parameter's *full* gradient (its global norm, from
# the shards), and the monitor's parameter norms are those of the full tensors: equal to the
# unsharded copy.
xs, ys = torch.randn(32, 8), torch.randn(32, 4)
with hs.clip_grads(net, max_norm=0.05), hs.Monitor(net, every=1, alerts="off") as mon:
    F.mse_loss(net(xs), ys).backward()
    mon.step()
with hs.clip_grads(plain, max_norm=0.05):
    F.mse_loss(plain(xs), ys).backward()
for name, p in plain.named_parameters():
    sharded = dict(net.named_parameters())[name].grad.full_tensor()
    print(
        f"{name:9s} grad equal: {torch.allclose(sharded, p.grad, atol=1e-6)}",
        f"| monitor grad_norm {mon.records[0].params[name]['grad_norm']:.4f}",
        f"(unsharded {p.grad.norm():.4f})",
    )

# %%
# Leave the process group when done.
del net, mon
dist.destroy_process_group()
