"""Sharded parameters (docs/pitfalls.md §19): gradient edits, clipping and the monitor on FSDP2
(``fully_shard`` on a CPU mesh, gloo, 2 processes on loopback) and tensor-parallel ``DTensor``
parameters, each compared with one process running the combined batch on a plain model."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.dist import WORLD, assert_records_close, launch, read_jsonl

MAX_NORM = 0.05
VALUE = 0.02


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 7 rows: uneven shards (4 + 3); the bias of the last layer (1 value) leaves rank 1 empty
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 1))


def make_data(steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, 8, 5, generator=g), torch.randn(steps, 8, 1, generator=g)


def fsdp_model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_model()
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }


# -- gradient edits and clipping ------------------------------------------------------------------
EDITS: dict[str, Callable[[nn.Module], hs.HookScope]] = {
    "clip_max_norm": lambda m: hs.clip_grads(m, max_norm=MAX_NORM),
    "clip_value": lambda m: hs.clip_grads(m, value=VALUE),
    "edit": lambda m: hs.edit_grads(
        m,
        {
            "0.bias": hs.ops.zero(),
            "2.weight": hs.ops.scale(3.0),
            "4.bias": torch.tensor([0.5]),  # a full replacement tensor, laid out as the shards
        },
    ),
}


def _edit_worker(rank: int, tmp: str) -> None:
    xs, ys = make_data(2)
    x, y = xs[0].chunk(WORLD)[rank], ys[0].chunk(WORLD)[rank]
    out = {}
    for key, attach in EDITS.items():
        model = fsdp_model()
        with attach(model):
            nn.functional.mse_loss(model(x), y).backward()
        out[key] = full_grads(model)
    # gradient accumulation: two backward passes into .grad, each clamped on its own (FSDP2 adds
    # the second into .grad before any hook runs; hookscope sets .grad aside)
    model = fsdp_model()
    with hs.clip_grads(model, value=VALUE):
        for i in range(2):
            xi, yi = xs[i].chunk(WORLD)[rank], ys[i].chunk(WORLD)[rank]
            nn.functional.mse_loss(model(xi), yi).backward()
    out["accumulate"] = full_grads(model)
    # a second backward that does not start from the model's output (from a captured layer):
    # FSDP2 would add it into the edited .grad, and the clamp would apply to the sum -> refused
    model = fsdp_model()
    with hs.clip_grads(model, value=VALUE), hs.capture(model, "2", detach=False) as cap:
        nn.functional.mse_loss(model(x), y).backward()
        model(x)
        try:
            cap["2"].pow(2).sum().backward()
        except hs.HookscopeError as e:
            out["refused"] = str(e)
    if rank == 0:
        torch.save(out, os.path.join(tmp, "grads.pt"))


def reference_grads(
    factory: Callable[[], nn.Module] = make_model,
) -> dict[str, dict[str, torch.Tensor]]:
    """Independent of hookscope: torch.autograd.grad on the combined batch, edited by hand."""
    xs, ys = make_data(2)
    model = factory()
    names = [n for n, _ in model.named_parameters()]
    g, g2 = (
        dict(
            zip(
                names,
                torch.autograd.grad(
                    nn.functional.mse_loss(model(xs[i]), ys[i]), list(model.parameters())
                ),
            )
        )
        for i in range(2)
    )

    def clip(t: torch.Tensor) -> torch.Tensor:
        return t * min(1.0, MAX_NORM / (float(t.norm()) + 1e-6))

    edited = dict(g)
    edited["0.bias"] = torch.zeros_like(g["0.bias"])
    edited["2.weight"] = 3 * g["2.weight"]
    edited["4.bias"] = torch.tensor([0.5])
    return {
        "raw": g,
        "clip_max_norm": {n: clip(t) for n, t in g.items()},
        "clip_value": {n: t.clamp(-VALUE, VALUE) for n, t in g.items()},
        "accumulate": {
            n: t.clamp(-VALUE, VALUE) + g2[n].clamp(-VALUE, VALUE) for n, t in g.items()
        },
        "edit": edited,
    }


@pytest.mark.distributed
def test_fsdp2_edits_and_clipping_act_on_the_full_gradient(tmp_path):
    launch(_edit_worker, str(tmp_path))
    got, ref = torch.load(tmp_path / "grads.pt"), reference_grads()
    # the edits bind: every parameter's full gradient norm is above MAX_NORM, values exceed VALUE
    raw = ref.pop("raw")
    assert min(float(t.norm()) for t in raw.values()) > 2 * MAX_NORM
    assert all(float(t.abs().max()) > VALUE for t in raw.values())
    assert "edit would apply to their sum" in got.pop("refused")
    for key in [*EDITS, "accumulate"]:
        for name, want in ref[key].items():
            torch.testing.assert_close(
                got[key][name], want, rtol=1e-5, atol=1e-7, msg=f"{key} {name}"
            )
    norms = {n: float(t.norm()) for n, t in got["clip_max_norm"].items()}
    assert all(math.isclose(v, MAX_NORM, rel_tol=1e-4) for v in norms.values()), norms


# -- never silent ---------------------------------------------------------------------------------
class Tagged(torch.Tensor):
    """A tensor subclass hookscope does not know."""


def test_unknown_tensor_subclass_parameter_is_refused_at_attach_time():
    net = nn.Linear(2, 2)
    net.weight = nn.Parameter(torch.Tensor._make_subclass(Tagged, torch.randn(2, 2), True))
    for attach in (
        lambda: hs.clip_grads(net, max_norm=1.0),
        lambda: hs.edit_grads(net, {"weight": hs.ops.zero()}),
    ):
        with pytest.raises(hs.UnsupportedTensorError, match=r"parameter 'weight' is a .*Tagged"):
            attach()
    # bias alone is a plain parameter: accepted, and it acts
    with hs.clip_grads(net, value=1e-3, params="bias"):
        net(torch.full((3, 2), 10.0)).sum().backward()
    assert float(net.bias.grad.abs().max()) == pytest.approx(1e-3)


def test_unknown_tensor_subclass_activation_is_refused():
    class Wrap(nn.Module):
        def forward(self, x):
            return torch.Tensor._make_subclass(Tagged, x * 2, True)

    net = nn.Sequential(nn.Linear(2, 2), Wrap())
    with (
        hs.edit_grads(net, {"1": hs.ops.zero()}),
        pytest.raises(hs.UnsupportedTensorError, match=r"output of layer '1' is a .*Tagged"),
    ):
        net(torch.ones(1, 2))


# -- the monitor ----------------------------------------------------------------------------------
STEPS = 2


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()  # NaN for a negative input


def train(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, out: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = hs.JsonlSink(out, append=False)
    with hs.Monitor(model, sinks=[sink], alerts="off", sentinel=True) as mon:
        for x, y in zip(xs, ys):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        assert mon.nonfinite is None


def nan_origins(model: nn.Module, x: torch.Tensor) -> tuple[str, str]:
    """(sentinel's origin, find_nonfinite's origin) of a NaN made by layer '1' (Sqrt)."""
    with hs.Monitor(model, stats=(), alerts="off", sentinel=True) as mon:
        model(x).sum().backward()
        mon.step()
    found = hs.find_nonfinite(model, x)
    return mon.nonfinite.layer, found.layer


def _monitor_worker(rank: int, tmp: str) -> None:
    xs, ys = make_data(STEPS)
    model = fsdp_model()
    train(
        model,
        xs.chunk(WORLD, dim=1)[rank],
        ys.chunk(WORLD, dim=1)[rank],
        os.path.join(tmp, f"rank{rank}.jsonl"),
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(5, 3), Sqrt(), nn.Linear(3, 1))
    fully_shard(bad)
    layers = nan_origins(bad, xs[0].chunk(WORLD)[rank])
    with open(os.path.join(tmp, f"nan{rank}.txt"), "w") as f:
        f.write(",".join(layers))


@pytest.mark.distributed
def test_fsdp2_monitor_equals_one_process_on_the_combined_batch(tmp_path):
    launch(_monitor_worker, str(tmp_path))
    xs, ys = make_data(STEPS)
    train(make_model(), xs, ys, str(tmp_path / "single.jsonl"))
    got, ref = read_jsonl(tmp_path / "rank0.jsonl"), read_jsonl(tmp_path / "single.jsonl")
    assert read_jsonl(tmp_path / "rank1.jsonl") == []  # written once, by rank 0
    assert set(ref[0]["params"]) == {f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    assert_records_close(got, ref, STEPS)
    # a NaN made by layer '1' (Sqrt of a negative): the sentinel and find_nonfinite name it on
    # every rank, as in one process
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(5, 3), Sqrt(), nn.Linear(3, 1))
    want = nan_origins(bad, xs[0])
    assert want == ("1", "1")
    for rank in range(WORLD):
        assert (tmp_path / f"nan{rank}.txt").read_text().split(",") == list(want)


# -- FSDP1 (FullyShardedDataParallel): refused for parameter statistics, layers exact ------------
LAYER_STATS = ("activations", "gradients")


def train_layers(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, out: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = hs.JsonlSink(out, append=False)
    with hs.Monitor(model, stats=LAYER_STATS, sinks=[sink], alerts="off") as mon:
        for x, y in zip(xs, ys):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()


def _fsdp1_worker(rank: int, tmp: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    xs, ys = make_data(STEPS)
    for orig in (False, True):
        model = FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=orig)
        with pytest.raises(hs.UnsupportedTensorError) as err:
            hs.Monitor(model)
        # gradient edits: refused when attached (the flat parameter, or the original ones)
        # summary: counts this rank's flat shards, and says so
        with pytest.warns(hs.HookscopeWarning, match=r"FSDP1 .*\('<root>'\).*this rank's"):
            s = hs.summary(model, xs[0, :2])
        assert s.totals.params < sum(p.numel() for p in make_model().parameters())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:  # the module alone cannot run (its weights are 1-D slices outside forward)
                hs.summary(model.module, xs[0, :2])
            except RuntimeError as e:
                assert "must be a matrix" in str(e) or "size" in str(e)
        # inside the wrapper: found by FSDP1's marks on the original parameters
        # (use_orig_params=True) or on the FlatParameter it registers on that module (False)
        said = [w for w in seen if "FSDP1" in str(w.message)]
        assert len(said) == 1
        fsdp1_edits = [
            lambda m: hs.clip_grads(m, max_norm=MAX_NORM),
            lambda m: hs.clip_grads(m, value=VALUE),
            lambda m: hs.edit_grads(m, {"*": hs.ops.zero()}),
        ]
        for attach in fsdp1_edits:
            with pytest.raises(hs.UnsupportedTensorError, match=r"managed by FSDP1.*fully_shard"):
                attach(model)
            assert not hs.hooks_on(model)
        # the module inside the wrapper (what trainers give their callbacks): found all the same
        with pytest.raises(hs.UnsupportedTensorError) as inner:
            hs.Monitor(model.module)
        with open(os.path.join(tmp, f"err{rank}-{orig}.txt"), "w") as f:
            f.write(str(err.value) + "\n" + str(inner.value))
        train_layers(
            model,
            xs.chunk(WORLD, dim=1)[rank],
            ys.chunk(WORLD, dim=1)[rank],
            os.path.join(tmp, f"rank{rank}-{orig}.jsonl"),
        )
        del model


@pytest.mark.distributed
def test_fsdp1_monitor_refuses_parameter_stats_and_records_layers_exactly(tmp_path):
    """FSDP1 keeps parameters as flat shards: parameter statistics used to be silently missing
    (use_orig_params=False) or one rank's slice (True); now refused by name. The layer
    statistics equal one process on the combined batch."""
    launch(_fsdp1_worker, str(tmp_path))
    xs, ys = make_data(STEPS)
    train_layers(make_model(), xs, ys, str(tmp_path / "single.jsonl"))
    ref = read_jsonl(tmp_path / "single.jsonl")
    for orig in (False, True):
        for rank in range(WORLD):
            msg, inner = (tmp_path / f"err{rank}-{orig}.txt").read_text().split("\n")
            assert "wrapped in FSDP1 FullyShardedDataParallel ('<root>')" in msg
            if orig:  # the original parameters carry FSDP1's mark
                assert "parameters are managed by FSDP1" in inner and "'0.weight'" in inner
            else:  # the parameters are gone: plain tensor views in their place
                assert "weights are plain tensors" in inner and "'0.weight', '0.bias'" in inner
            for m in (msg, inner):
                assert "fully_shard" in m and "stats=('activations', 'gradients')" in m
        got = read_jsonl(tmp_path / f"rank0-{orig}.jsonl")
        assert read_jsonl(tmp_path / f"rank1-{orig}.jsonl") == []  # written once, by rank 0
        prefix = "_fsdp_wrapped_module."
        for d in got:
            d["layers"] = {k.removeprefix(prefix): v for k, v in d["layers"].items()}
        assert set(ref[0]["layers"]) == {str(i) for i in range(5)}
        assert_records_close(got, ref, STEPS)


# -- tensor parallel ------------------------------------------------------------------------------
def make_tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 1))


def make_zero_tp_model() -> nn.Module:
    """Layer '0' outputs zeros (an all-zero shard on every rank) and, with a constant layer '2',
    its output gradient is the same on every rank too: values alone cannot tell these shards from
    a replicated output; the plan can."""
    model = make_tp_model()
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[2].weight.fill_(0.1)
    return model


def _tp_worker(rank: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    xs, ys = make_data(STEPS)  # tensor parallel: every rank runs the whole batch
    for tag, colwise in (("", ColwiseParallel()), ("dt", ColwiseParallel(use_local_output=False))):
        # use_local_output=False: layers '0' and '1' output (and get gradients as) DTensors
        plan = {"0": colwise, "2": RowwiseParallel()}
        model = parallelize_module(make_tp_model(), mesh, plan)
        train(model, xs, ys, os.path.join(tmp, f"{tag}rank{rank}.jsonl"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = parallelize_module(make_zero_tp_model(), mesh, plan)
    train(model, xs, ys, os.path.join(tmp, f"zerorank{rank}.jsonl"))
    # an output the plan declares Partial (its shards are not its values): refused, named
    from torch.distributed.tensor import Partial

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Partial())}
    model = parallelize_module(make_tp_model(), mesh, plan)
    with hs.Monitor(model, alerts="off"), pytest.raises(hs.UnsupportedTensorError) as e:
        model(xs[0])
    with open(os.path.join(tmp, f"partial{rank}.txt"), "w") as f:
        f.write(str(e.value))


@pytest.mark.distributed
def test_tensor_parallel_monitor_equals_one_process(tmp_path):
    launch(_tp_worker, str(tmp_path))
    xs, ys = make_data(STEPS)
    train(make_tp_model(), xs, ys, str(tmp_path / "single.jsonl"))
    ref = read_jsonl(tmp_path / "single.jsonl")
    assert set(ref[0]["layers"]) == {"0", "1", "2", "3", "4"}  # sharded ('0', '1') and replicated
    assert_records_close(read_jsonl(tmp_path / "rank0.jsonl"), ref, STEPS)
    assert_records_close(read_jsonl(tmp_path / "dtrank0.jsonl"), ref, STEPS)
    # all-zero shards with equal gradients on both ranks: still two shards ('0', '1': the output
    # gradient norm of the whole output, sqrt(2) times a rank's), not one replicated copy
    train(make_zero_tp_model(), xs, ys, str(tmp_path / "zero.jsonl"))
    zero = read_jsonl(tmp_path / "zero.jsonl")
    assert zero[0]["layers"]["0"]["absmax"] == 0.0 and zero[0]["layers"]["0"]["grad_norm"] > 0
    assert_records_close(read_jsonl(tmp_path / "zerorank0.jsonl"), zero, STEPS)
    for rank in range(WORLD):
        said = (tmp_path / f"partial{rank}.txt").read_text()
        assert "layer '2' is declared Partial" in said and "Declare Shard or Replicate" in said


class CopyingLinear(nn.Module):
    """Runs on a copy of its weight and writes ``weight.grad`` itself (as FSDP1 and offloading
    wrappers do): a tensor hook on ``weight`` never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.detach().requires_grad_()

        def write(g: torch.Tensor) -> None:
            self.weight.grad = g.clone()

        w.register_hook(write)
        return x @ w.t()


@pytest.mark.parametrize(
    "attach",
    [
        lambda m: hs.clip_grads(m, value=1e-3),
        lambda m: hs.edit_grads(m, {"weight": hs.ops.zero()}),
    ],
    ids=["clip_grads", "edit_grads"],
)
def test_a_gradient_hook_that_never_fires_is_reported_at_the_end_of_backward(attach):
    net = CopyingLinear()
    with attach(net), pytest.raises(hs.HookscopeError, match=r"parameter 'weight' .* NOT applied"):
        net(torch.full((3, 2), 10.0)).sum().backward()
    assert float(net.weight.grad.abs().max()) == 30.0  # indeed unedited: the error was right
    # a plain layer: the hook fires, no error, over several steps
    lin = nn.Linear(2, 2)
    with attach(lin):
        for _ in range(3):
            lin.zero_grad()  # (accumulating backward passes under clip_grads is warned about)
            lin(torch.full((3, 2), 10.0)).sum().backward()
            assert float(lin.weight.grad.abs().max()) < 1.001e-3  # clamped (or zeroed)


# -- 2-D mesh: FSDP2 over the data-parallel dimension, tensor parallel over the other ---------------
def mesh_2d_model(factory: Callable[[], nn.Module] = make_tp_model) -> tuple[nn.Module, int]:
    """``factory()`` split colwise/rowwise over 'tp' and sharded by FSDP2 over 'dp' of a 2x2
    mesh; returns it and this rank's data-parallel coordinate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(
        factory(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank()


def _mesh_2d_worker(rank: int, tmp: str) -> None:
    xs, ys = make_data(STEPS)
    model, dp = mesh_2d_model()
    # each data-parallel group runs its half of the batch (the same within a tensor-parallel group)
    train(
        model, xs.chunk(2, dim=1)[dp], ys.chunk(2, dim=1)[dp], os.path.join(tmp, f"r{rank}.jsonl")
    )
    out = {}
    for key, attach in EDITS.items():
        model, dp = mesh_2d_model()
        x, y = xs[0].chunk(2)[dp], ys[0].chunk(2)[dp]
        with attach(model):
            nn.functional.mse_loss(model(x), y).backward()
        out[key] = full_grads(model)
    torch.manual_seed(0)
    bad, dp = mesh_2d_model(
        lambda: nn.Sequential(nn.Linear(5, 4), Sqrt(), nn.Linear(4, 4), nn.Linear(4, 1))
    )
    out["nan"] = nan_origins(bad, xs[0].chunk(2)[dp])
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_with_tensor_parallel_on_a_2x2_mesh_equals_one_process(tmp_path):
    """4 gloo ranks: Monitor layer and parameter statistics, the sentinel, clip_grads and
    edit_grads equal one process on the combined batch."""
    launch(_mesh_2d_worker, str(tmp_path), world=4)
    xs, ys = make_data(STEPS)
    train(make_tp_model(), xs, ys, str(tmp_path / "single.jsonl"))
    ref = read_jsonl(tmp_path / "single.jsonl")
    assert set(ref[0]["layers"]) == {"0", "1", "2", "3", "4"}
    assert set(ref[0]["params"]) == {f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    assert_records_close(read_jsonl(tmp_path / "r0.jsonl"), ref, STEPS)
    for rank in range(1, 4):
        assert read_jsonl(tmp_path / f"r{rank}.jsonl") == []  # written once, by rank 0
    want = reference_grads(make_tp_model)
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(5, 4), Sqrt(), nn.Linear(4, 4), nn.Linear(4, 1))
    nan = nan_origins(bad, xs[0])
    assert nan == ("1", "1")
    for rank in range(4):
        got = torch.load(tmp_path / f"out{rank}.pt")
        assert tuple(got.pop("nan")) == nan
        for key in EDITS:
            assert got[key].keys() == want[key].keys()
            for name, t in want[key].items():
                torch.testing.assert_close(
                    got[key][name], t, rtol=1e-5, atol=1e-7, msg=f"{rank} {key} {name}"
                )
