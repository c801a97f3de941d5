# torchrun --nproc-per-node 2 examples/train_distributed.py {ddp,fsdp,tp}
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import hookscope as hs

dist.init_process_group("gloo")  # CPU; "nccl" on GPUs (init_device_mesh("cuda", ...))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1))

mode = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
if mode == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
elif mode == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for i in (0, 2):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
else:  # tensor parallel: every rank runs the same batch on its slice of the layers
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

opt = torch.optim.SGD(model.parameters(), lr=0.05)
clip = hs.clip_grads(model, max_norm=1.0)  # per parameter, on the full, averaged gradient
with hs.Monitor(model, every=5, sinks=[hs.JsonlSink(f"stats-{mode}.jsonl")], sentinel=True) as mon:
    for step in range(20):
        g = torch.Generator().manual_seed(step if mode == "tp" else step * world + rank)
        x = torch.randn(32, 16, generator=g)
        F.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        rec = mon.step(opt)
        opt.zero_grad()
        if rec is not None and rank == 0:
            print(step, {n: round(s["grad_norm"], 4) for n, s in rec.params.items()})
clip.remove()
# free the model before the process group: a DDP model still alive at interpreter exit, after
# destroy_process_group, aborts the process about 1 run in 10 here ("terminate called without an
# active exception", gloo, torch 2.14; the same without hookscope)
del model, opt, mon, clip
gc.collect()
dist.destroy_process_group()
