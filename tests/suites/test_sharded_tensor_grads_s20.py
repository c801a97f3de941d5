"""tensor_grads on a parameter sharded by FSDP2 (a DTensor): its own gradient hooks never run
(FSDP2 computes the unsharded parameter's gradient and reduces it into .grad), and the read
said "backward() has not run, or it is not part of the loss", which was false. It now names
the cause and the fix; the parameter's .grad, which the fix points to, holds the gradient."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, launch


def _worker(rank: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model, mesh=mesh)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    with hs.tensor_grads(model[0].weight) as g:
        model(x).pow(2).mean().backward()
    try:
        g[0]
        said = ""
    except hs.NoGradientError as e:
        said = str(e)
    if rank == 0:
        with open(os.path.join(tmp, "said.json"), "w") as f:
            json.dump({"said": said, "grad": model[0].weight.grad is not None}, f)


def test_tensor_grads_of_an_fsdp2_parameter_names_the_cause(tmp_path):
    launch(_worker, str(tmp_path))
    got = json.loads((tmp_path / "said.json").read_text())
    assert "sharded parameter" in got["said"] and "p.grad" in got["said"]
    assert got["grad"]
