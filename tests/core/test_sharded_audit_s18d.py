"""Audit of the sharded class (s18d): what capture keeps for a tensor-parallel layer, checked
against the plain model on the same batch (2 gloo ranks on loopback)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, launch


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def batch() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def _tp_capture(rank: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for local_output in (True, False):
        model = make_mlp()
        if local_output:  # the default plan: a ColwiseParallel layer hands on its local shard
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        else:
            plan = {
                "0": ColwiseParallel(use_local_output=False),
                "2": RowwiseParallel(input_layouts=Shard(-1)),
            }
        parallelize_module(model, mesh, plan)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with hs.capture(model, ["0", "1", "2"], grads=True) as cap:
                model(batch()).sum().backward()
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in (("0", cap["0"]), ("1", cap["1"]), ("2", cap["2"]))
        }
        grad0 = cap.grads["0"]
        out[local_output] = {
            "warned": [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)],
            "full": full,
            "grad0": grad0.full_tensor() if hasattr(grad0, "full_tensor") else grad0,
            "grad2": cap.grads["2"],
        }
    if rank == 0:
        torch.save(out, os.path.join(tmp, "tp.pt"))


@pytest.mark.distributed
def test_tensor_parallel_capture_warns_for_local_shards_and_dtensors_are_the_full_output(
    tmp_path,
):
    """A ColwiseParallel layer (default use_local_output=True) returns this rank's columns as a
    plain tensor: capture kept them as if they were the output, silently (half of the 6
    features). Now it warns naming the layer and the fix; the replicated output of the
    RowwiseParallel layer and DTensor outputs (use_local_output=False) are the full values."""
    launch(_tp_capture, str(tmp_path), timeout=120)
    got = torch.load(tmp_path / "tp.pt")
    ref = make_mlp()
    with hs.capture(ref, ["0", "1", "2"], grads=True) as cap:
        ref(batch()).sum().backward()
    shards = got[True]
    assert len(shards["warned"]) == 2, shards["warned"]
    for name, msg in zip(["0", "1"], shards["warned"]):
        assert f"layer {name!r} is this rank's shard" in msg and "use_local_output=False" in msg
    # what is kept is rank 0's columns, exactly; the replicated output is the full one
    torch.testing.assert_close(shards["full"]["0"], cap["0"][:, :3], rtol=0, atol=1e-6)
    torch.testing.assert_close(shards["full"]["2"], cap["2"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shards["grad2"], cap.grads["2"], rtol=1e-5, atol=1e-6)
    dtensors = got[False]
    assert dtensors["warned"] == []
    for name in ("0", "1", "2"):
        torch.testing.assert_close(dtensors["full"][name], cap[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dtensors["grad0"], cap.grads["0"], rtol=1e-5, atol=1e-6)


def test_capture_of_a_plain_model_adds_no_tensor_parallel_hooks():
    model = make_mlp()
    with hs.capture(model, ["0", "2"]) as cap:
        counts = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
        model(batch())
    assert counts == [0, 1, 0, 1]
    torch.testing.assert_close(cap["2"], model(batch()))


# -- the sentinel: a NaN made on one rank reaches every rank through the gradient reduction -------
class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


def make_log_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), Log(), nn.Linear(4, 1))


def log_batch() -> torch.Tensor:
    """Rows 0-3 (rank 0's share) keep Log's input positive; rows 4-7 (rank 1's) make a NaN."""
    return torch.cat([torch.full((4, 5), -0.5), torch.full((4, 5), 0.5)])


def sentinel_origin(
    model: nn.Module, x: torch.Tensor, out: str, stats: tuple = ("parameters",)
) -> tuple:
    with hs.Monitor(
        model,
        stats=stats,
        sinks=[hs.JsonlSink(out, append=False)],
        alerts="off",
        sentinel=True,
    ) as mon:
        model(x).sum().backward()
        mon.step()
    o = mon.nonfinite
    return None if o is None else (o.layer, o.phase, o.kind, o.module_type)


def _sentinel(rank: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    x = log_batch().chunk(WORLD)[rank]
    got = {}
    if rank == 0:  # a plain model's gradients are not reduced: no collective, one rank alone
        one = os.path.join(tmp, "plain.jsonl")
        got["plain"] = sentinel_origin(make_log_net(), log_batch()[4:], one, stats=())
    ddp = nn.parallel.DistributedDataParallel(make_log_net())
    got["ddp"] = sentinel_origin(ddp, x, os.path.join(tmp, f"ddp{rank}.jsonl"))
    fsdp = make_log_net()
    fully_shard(fsdp)
    got["fsdp2"] = sentinel_origin(fsdp, x, os.path.join(tmp, f"fsdp2{rank}.jsonl"))
    torch.save(got, os.path.join(tmp, f"origin{rank}.pt"))


@pytest.mark.distributed
def test_sentinel_names_the_rank_s_layer_that_made_a_nan_on_every_rank(tmp_path):
    """A NaN made by layer '2' on rank 1 only reaches rank 0 through DDP's all-reduce (FSDP2's
    reduce-scatter): rank 0's own forward and backward were finite, and its sentinel blamed
    layer '3' in the backward pass (a NaN parameter gradient), which rank 0, the only rank that
    writes, wrote to the sinks. Every rank now names what one process on the combined batch
    names: the forward pass of layer '2'."""
    from helpers.dist import read_jsonl

    launch(_sentinel, str(tmp_path), timeout=120)
    want = sentinel_origin(make_log_net(), log_batch(), str(tmp_path / "one.jsonl"))
    assert want == ("2", "forward", "nan", "Log")
    assert torch.load(tmp_path / "origin0.pt")["plain"] == want
    for kind in ("ddp", "fsdp2"):
        for rank in range(WORLD):
            assert torch.load(tmp_path / f"origin{rank}.pt")[kind] == want, (kind, rank)
        (rec,) = read_jsonl(tmp_path / f"{kind}0.jsonl")
        o = rec["nonfinite"]
        assert (o["layer"], o["phase"], o["kind"], o["module_type"]) == want, kind


# -- the monitor: unequal batch shares ------------------------------------------------------------
def uneven_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, out: str) -> list[str]:
    """One monitored step; the HookscopeWarnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with hs.Monitor(model, sinks=[hs.JsonlSink(out, append=False)], alerts="off") as mon:
            nn.functional.mse_loss(model(x), y).backward()
            mon.step()
    return [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)]


def uneven_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(7, 5, generator=g), torch.randn(7, 1, generator=g)


def _uneven(rank: int, tmp: str) -> None:
    x, y = uneven_data()
    rows = [slice(0, 4), slice(4, 7)][rank]  # the last batch of an epoch: 4 + 3 rows
    said = {}
    ddp = nn.parallel.DistributedDataParallel(make_mlp_5())
    said["uneven"] = uneven_step(ddp, x[rows], y[rows], os.path.join(tmp, f"uneven{rank}.jsonl"))
    even = [slice(0, 3), slice(3, 6)][rank]
    ddp = nn.parallel.DistributedDataParallel(make_mlp_5())
    said["even"] = uneven_step(ddp, x[even], y[even], os.path.join(tmp, f"even{rank}.jsonl"))
    torch.save(said, os.path.join(tmp, f"said{rank}.pt"))


def make_mlp_5() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))


@pytest.mark.distributed
def test_monitor_warns_that_unequal_shares_make_gradients_differ_from_the_combined_batch(
    tmp_path,
):
    """Ranks with 4 and 3 rows (a last batch): DDP averages the ranks' mean losses, so the
    gradients (layer and parameter) are not those of one process on the 7 rows, and the record
    said nothing. The activation statistics (combined by counts) are the combined batch's; the
    monitor now warns, naming the shares, that the gradient statistics are not."""
    from helpers.dist import read_jsonl

    launch(_uneven, str(tmp_path), timeout=120)
    x, y = uneven_data()
    uneven_step(make_mlp_5(), x, y, str(tmp_path / "one.jsonl"))
    (one,) = read_jsonl(tmp_path / "one.jsonl")
    (got,) = read_jsonl(tmp_path / "uneven0.jsonl")
    for layer, stats in one["layers"].items():
        for k, v in stats.items():
            if not k.startswith("grad"):
                assert got["layers"][layer][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (layer, k)
    # the gradients differ indeed: DDP's average of the ranks' means, not the mean of 7 rows
    assert got["params"]["2.weight"]["grad_norm"] != pytest.approx(
        one["params"]["2.weight"]["grad_norm"], rel=1e-3
    )
    for rank in range(WORLD):
        said = torch.load(tmp_path / f"said{rank}.pt")
        assert said["even"] == []
        (msg,) = said["uneven"]
        assert "unequal batch shares" in msg and "saw [24, 18] values" in msg, msg


# -- extract on 2 ranks: a model whose forward communicates ---------------------------------------
def make_bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).eval()


def extract_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(10, 5, generator=g))


def _extract(rank: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    said = {}
    fsdp = make_bn_net()
    fully_shard(fsdp)
    ddp = nn.parallel.DistributedDataParallel(make_bn_net())
    for kind, model, layer in (("fsdp2", fsdp, "2"), ("ddp", ddp, "module.2")):
        try:
            hs.extract(model, extract_data(), layer, os.path.join(tmp, kind), progress=False)
            said[kind] = None
        except hs.HookscopeError as e:
            said[kind] = str(e)
    # what the refusal says to do: the module inside DDP (the same weights, no communication)
    hs.extract(ddp.module, extract_data(), "2", os.path.join(tmp, "inner"), batch_size=3)
    torch.save(said, os.path.join(tmp, f"extract{rank}.pt"))


@pytest.mark.distributed
def test_extract_on_two_ranks_refuses_a_model_whose_forward_communicates(tmp_path):
    """Each rank extracts its own batches and rank 0 probes the model alone: an FSDP2 model
    (its forward all-gathers the weights) or a DDP model with buffers (its forward broadcasts
    them) waited for ranks that never joined: a hang. Refused on every rank alike, naming the
    fix; the module inside DDP extracts exactly what one process computes."""
    launch(_extract, str(tmp_path), timeout=60)
    for rank in range(WORLD):
        said = torch.load(tmp_path / f"extract{rank}.pt")
        assert "sharded across the ranks" in said["fsdp2"] and "'0.weight'" in said["fsdp2"]
        assert "broadcast_buffers=True" in said["ddp"] and "ddp.module" in said["ddp"]
    net = make_bn_net()
    with torch.no_grad():
        want = net[:3](extract_data().tensors[0])
    got = hs.load_features(tmp_path / "inner")
    assert got.valid.all()
    torch.testing.assert_close(torch.tensor(got["2"]), want, rtol=1e-5, atol=1e-6)


# -- find_nonfinite on FSDP2 with a NaN on one rank ------------------------------------------------
def make_deep() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))


def nan_batch(rank: int) -> torch.Tensor:
    x = torch.ones(4, 5)
    if rank == 1:
        x[0, 0] = float("nan")
    return x


def step_batch() -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(5))


def _find(rank: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = make_deep()
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        o = hs.find_nonfinite(model, nan_batch(rank))
    said = [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)]
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    # the next training step: its collectives pair with the other rank's own
    model(step_batch().chunk(WORLD)[rank]).pow(2).mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    found = None if o is None else (o.layer, o.phase, o.kind)
    out = {"found": found, "left": left, "grads": grads, "said": said}
    torch.save(out, os.path.join(tmp, f"find{rank}.pt"))


@pytest.mark.distributed
def test_find_nonfinite_on_fsdp2_with_a_nan_on_one_rank_makes_the_same_collectives_on_every_rank(
    tmp_path,
):
    """The rank whose forward found the NaN returned before the backward that the other rank
    ran: FSDP2's backward all-gathers waited for it, or were paired with its next step's
    (a crash, or a silent mix). The ranks now agree: every rank skips the backward, each
    reports its own forward pass as one process on its share does, the other rank warns that
    its backward pass was not checked, and the next step's gradients are one process's."""
    launch(_find, str(tmp_path), timeout=60)
    want = []
    for rank in range(WORLD):
        o = hs.find_nonfinite(make_deep(), nan_batch(rank))
        want.append(None if o is None else (o.layer, o.phase, o.kind))
    assert want == [None, ("<input>", "forward", "nan")]
    ref = make_deep()
    ref(step_batch()).pow(2).mean().backward()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"find{rank}.pt")
        assert got["found"] == want[rank] and got["left"] == []
        if rank == 0:
            (msg,) = got["said"]
            assert "another rank found a NaN/Inf" in msg and "not checked" in msg
        else:
            assert got["said"] == []
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-5, atol=1e-7)


# -- edit of a tensor-parallel layer's output -----------------------------------------------------
EDITS = {"clip": lambda: hs.ops.clip_norm(0.5), "scale": lambda: hs.ops.scale(2.0)}


def _tp_edit(rank: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for local_output in (True, False):
        model = make_mlp()
        if local_output:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        else:
            plan = {
                "0": ColwiseParallel(use_local_output=False),
                "2": RowwiseParallel(input_layouts=Shard(-1)),
            }
        parallelize_module(model, mesh, plan)
        for key, op in EDITS.items():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with hs.edit(model, {"0": op()}):
                    y = model(batch())
            said = [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)]
            y = y.full_tensor() if hasattr(y, "full_tensor") else y
            out[local_output, key] = (said, torch.tensor(y.detach().tolist()))
            # the same edit on the gradient of the layer's output: its shard too
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with hs.edit_grads(model, {"0": op()}):
                    model(batch()).pow(2).sum().backward()
            said = [str(w.message) for w in seen if issubclass(w.category, hs.HookscopeWarning)]
            g = model[0].weight.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            out[local_output, key, "grad"] = (said, torch.tensor(g.tolist()))
            model.zero_grad()
    if rank == 0:
        torch.save(out, os.path.join(tmp, "edit.pt"))


@pytest.mark.distributed
def test_tensor_parallel_edit_that_reads_the_whole_output_warns_on_a_local_shard(tmp_path):
    """clip_norm on a ColwiseParallel layer's local output took each rank's part's norm: the
    model's output differed from the plain model's, silently. Now it warns naming the layer;
    an elementwise edit (scale) is exact on shards and says nothing; on a DTensor output
    (use_local_output=False) clip_norm takes the full norm and equals the plain model."""
    launch(_tp_edit, str(tmp_path), timeout=120)
    got = torch.load(tmp_path / "edit.pt")
    want = {}
    for key, op in EDITS.items():
        ref = make_mlp()
        with hs.edit(ref, {"0": op()}):
            want[key] = ref(batch()).detach()
        with hs.edit_grads(ref, {"0": op()}):
            ref(batch()).pow(2).sum().backward()
        want[key, "grad"] = ref[0].weight.grad
    said, y = got[True, "clip"]
    assert len(said) == 1 and "the edit of '0' acts on this rank's part" in said[0], said
    assert not torch.allclose(y, want["clip"], atol=1e-4)  # the shards' norms, not the output's
    said, g = got[True, "clip", "grad"]
    assert len(said) == 1 and "the gradient of '0' acts on this rank's part" in said[0], said
    assert not torch.allclose(g, want["clip", "grad"], atol=1e-4)
    for local_output, key in [(True, "scale"), (False, "scale"), (False, "clip")]:
        said, y = got[local_output, key]
        assert said == [], (local_output, key, said)
        torch.testing.assert_close(y, want[key], rtol=1e-5, atol=1e-6)
        said, g = got[local_output, key, "grad"]
        assert said == [], (local_output, key, "grad", said)
        torch.testing.assert_close(g, want[key, "grad"], rtol=1e-5, atol=1e-6)
