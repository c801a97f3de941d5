"""Checkpointing plans are safe to apply: one training step under ``apply_checkpointing`` gives
the gradients, buffers and outputs of the same step without checkpointing (exactly: the recompute
runs the same operations), or hookscope refuses by name. Every reference here is a plain run of
a deep copy of the model, with the same random seed."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.lm import tiny_gpt2, tiny_llama


def step(model, x, names=None, *, kind="non_reentrant", loss=None, seed=1, **kw):
    """One forward + backward (checkpointing ``names`` when given) on ``model`` itself; returns
    ``(output, gradients, buffers)``."""
    torch.manual_seed(seed)
    handle = hs.apply_checkpointing(model, names, kind=kind, **kw) if names is not None else None
    try:
        out = model(x)
        (loss(out) if loss else out.float().sum()).backward()
    finally:
        if handle is not None:
            handle.remove()
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return out, grads, buffers


def assert_same_step(model, x, names, **kw):
    """The step with ``names`` checkpointed equals the step without, gradient for gradient and
    buffer for buffer, exactly."""
    _, g0, b0 = step(copy.deepcopy(model), x, **{k: v for k, v in kw.items() if k == "loss"})
    _, g1, b1 = step(copy.deepcopy(model), x, names, **kw)
    assert any(g is not None for g in g0.values())
    for n, g in g0.items():
        assert (g is None) == (g1[n] is None), n
        if g is not None:
            assert torch.equal(g, g1[n]), f"gradient of {n} differs: {(g - g1[n]).abs().max()}"
    for n, b in b0.items():
        assert torch.equal(b, b1[n]), f"buffer {n}: {b.flatten()[:4]} != {b1[n].flatten()[:4]}"


# -- buffers, attributes: the recompute replays the call ------------------------------------------


def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("kind", ["non_reentrant", "reentrant", "selective"])
@pytest.mark.parametrize("names", [["1"], ["0", "1"]])
def test_batchnorm_statistics_updated_once(kind, names):
    # the recompute would update running_mean, running_var and num_batches_tracked again
    net, x = bn_net(), torch.randn(6, 4)
    policy = [torch.ops.aten.addmm.default] if kind == "selective" else None
    assert_same_step(net, x, names, kind=kind, policy=policy)
    # and over several steps (the learned buffers are kept from the second call on)
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    with hs.apply_checkpointing(b, names, kind=kind, policy=policy):
        for i in range(3):
            step(a, x + i)
            step(b, x + i)
    assert a[1].num_batches_tracked.item() == 3
    for n, buf in a.named_buffers():
        assert torch.equal(buf, dict(b.named_buffers())[n])


class Scaler(nn.Module):
    """A forward that reads a buffer it then updates, counts its calls in a plain attribute and
    reassigns a second buffer: the recompute must see the values of its call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def forward(self, x):
        y = self.lin(x) * (self.scale + 0) * (1 + self.calls)
        self.scale.mul_(0.5)
        self.steps = self.steps + 1
        self.calls += 1
        return y


def test_buffer_read_then_updated_recomputes_from_the_call():
    torch.manual_seed(0)
    net, x = nn.Sequential(Scaler(), nn.Tanh(), nn.Linear(4, 1)), torch.randn(3, 4)
    assert_same_step(net, x, ["0"])
    _, _, bufs = step(copy.deepcopy(net), x, ["0"])
    assert bufs["0.steps"].item() == 1 and torch.equal(bufs["0.scale"], torch.full((4,), 0.5))
    twin = copy.deepcopy(net)
    step(twin, x, ["0"])
    assert twin[0].calls == 1  # the counter counted the call once


@pytest.mark.parametrize("api", ["hook", "parametrization"])
def test_spectral_norm_inside_a_checkpointed_block(api):
    # its power iteration updates buffers in a pre-hook (old API) or a parametrization (new)
    from torch.nn.utils import parametrizations

    sn = nn.utils.spectral_norm if api == "hook" else parametrizations.spectral_norm
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(sn(nn.Linear(4, 8)), nn.Tanh()), nn.Linear(8, 1))
    assert_same_step(net, torch.randn(5, 4), ["0"])


def test_memory_profile_leaves_buffers_and_attributes_as_found():
    # a reassigned buffer goes back in its slot, a counter to its value
    torch.manual_seed(0)
    net = nn.Sequential(Scaler(), nn.Tanh(), nn.Linear(4, 1))
    steps = net[0].steps
    prof = hs.memory_profile(net, torch.randn(3, 4))
    assert prof.total_saved_bytes > 0
    assert net[0].steps is steps and steps.item() == 0
    assert net[0].calls == 0 and torch.equal(net[0].scale, torch.ones(4))


def test_eval_between_forward_and_backward_recomputes_in_training_mode():
    # the recompute runs with the module's mode at its call (dropout on), not the mode at backward
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Tanh())
    net, x = nn.Sequential(block, nn.Linear(16, 1)), torch.randn(8, 4)

    def run(names):
        model = copy.deepcopy(net)
        handle = hs.apply_checkpointing(model, names) if names else None
        torch.manual_seed(2)
        loss = model(x).sum()
        model.eval()
        loss.backward()
        if handle is not None:
            handle.remove()
        return [p.grad for p in model.parameters()], model

    want, _ = run(None)
    got, model = run(["0"])
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not model[0].training  # the mode set after the forward is what stays


def test_mobilenet_v3_plans_exact():
    # every module of mobilenet_v3_small has BatchNorm, in-place Hardswish/ReLU or both
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10, width_mult=0.5).train()
    x = torch.randn(2, 3, 32, 32)
    prof = hs.memory_profile(model, x)
    plan = prof.plan(int(prof.total_saved_bytes * 0.6))
    assert_same_step(model, x, plan)
    assert plan.modules and not set(plan.modules) & set(plan.excluded)
    assert "never checkpointed" in str(plan)
    inplace = {n for n, m in model.named_modules() if getattr(m, "inplace", False) is True}
    assert inplace and inplace <= set(prof.excluded)


# -- in-place modules: never planned, refused by name ---------------------------------------------


class Doubler(nn.Module):
    """Changes its input in place (no ``inplace`` attribute to tell)."""

    def forward(self, x):
        return x.mul_(2)


class LaterInPlace(nn.Module):
    """Module ``t``'s input is changed in place after ``t`` ran."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.t, self.b = nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        y = self.t(h)
        h.mul_(2)
        return self.b(y) + h.sum()


def hardswish_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Hardswish(inplace=True), nn.Linear(8, 1))


def test_inplace_modules_never_planned():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    for net, bad in [
        (hardswish_net(), "1"),
        (nn.Sequential(nn.Linear(4, 8), Doubler(), nn.Tanh(), nn.Linear(8, 1)), "1"),
        (LaterInPlace(), "t"),
    ]:
        prof = hs.memory_profile(net, x)
        assert list(prof.excluded) == [bad], prof.excluded
        for budget in range(0, prof.total_saved_bytes + 1, 16):
            try:
                plan = prof.plan(budget)
            except hs.PlanError as e:
                assert "left out" in str(e)
                continue
            assert bad not in plan.modules and plan.excluded == prof.excluded
    # a block holding the in-place module stays plannable, and exact
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.Hardswish(inplace=True))
    net = nn.Sequential(inner, nn.Linear(8, 1))
    prof = hs.memory_profile(net, x)
    assert list(prof.excluded) == ["0.1"]
    assert_same_step(net, x, ["0"])


def test_inplace_modules_refused_by_name():
    x = torch.randn(6, 4)
    with pytest.raises(hs.HookscopeError, match=r"layer '1' \(Hardswish\(inplace=True\)\).*block"):
        hs.apply_checkpointing(hardswish_net(), ["1"])
    # found by the run: the module changed its input during its call
    net = nn.Sequential(nn.Linear(4, 8), Doubler(), nn.Linear(8, 1))
    own_forward = r"layer '1' \(Doubler\).*by its own forward"
    with hs.apply_checkpointing(net, ["1"]), pytest.raises(hs.HookscopeError, match=own_forward):
        net(x)
    # changed after its call, under saved-tensor hooks (silently wrong gradients before)
    net = LaterInPlace()
    with hs.apply_checkpointing(net, ["t"]):
        with torch.autograd.graph.save_on_cpu():
            loss = net(x).sum()
        with pytest.raises(hs.HookscopeError, match=r"layer 't' \(Tanh\).*after its call"):
            loss.backward()


# -- key/value caches -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_attention_with_cache_on(family):
    # use_cache=True (the config's default): the recompute runs with the cache off
    model = (tiny_gpt2 if family == "gpt2" else tiny_llama)().train()
    assert model.config.use_cache
    ids = torch.randint(3, 40, (2, 12))
    stack = "transformer.h" if family == "gpt2" else "model.layers"
    attn = "attn" if family == "gpt2" else "self_attn"

    def loss(out):
        assert out.past_key_values.get_seq_length() == 12  # appended once
        return out.logits.sum()

    for names in ([f"{stack}.0", f"{stack}.1"], [f"{stack}.0.{attn}"]):
        assert_same_step(model, ids, names, loss=loss)
    prof = hs.memory_profile(model, ids, loss_fn=lambda o: o.logits.sum())
    assert_same_step(model, ids, prof.plan(prof.total_saved_bytes // 2), loss=loss)
    # selective checkpointing replays the call op for op: with the cache on, refused by name
    only_mm = [torch.ops.aten.mm.default]
    selective = hs.apply_checkpointing(model, [f"{stack}.0"], kind="selective", policy=only_mm)
    with selective, pytest.raises(hs.HookscopeError, match=rf"'{stack}.0'.*use_cache=False"):
        model(ids)
    # a cache that already holds positions for the layer cannot be replayed: refused by name
    first = model(ids[:, :6])
    held = rf"'{stack}.0'.*holds 6 .*use_cache=False"
    with (
        hs.apply_checkpointing(model, [f"{stack}.0"]),
        pytest.raises(hs.HookscopeError, match=held),
    ):
        model(ids[:, 6:], past_key_values=first.past_key_values)


# -- arguments ------------------------------------------------------------------------------------


def test_names_and_budget_arguments():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)])
    with hs.apply_checkpointing(net, "10") as handle:  # one name, not its characters
        assert handle.modules == ["10"]
        assert "forward" not in net[1].__dict__ and "forward" not in net[0].__dict__
    with pytest.raises(TypeError, match="list of module names"):
        hs.apply_checkpointing(net, 10)
    with pytest.raises(ValueError, match="empty"):
        hs.apply_checkpointing(net, [])
    with pytest.raises(ValueError, match=r"twice: \['1'\]"):
        hs.apply_checkpointing(net, ["1", "1"])
    prof = hs.memory_profile(net, torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"budget_bytes must be a number of bytes.*str '1000'"):
        prof.plan("1000")
    assert prof.plan(float(prof.total_saved_bytes)).modules == []


def test_meta_device_model_refused():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to("meta")
    with pytest.raises(hs.HookscopeError, match=r"'meta' device.*to_empty"):
        hs.memory_profile(net, torch.randn(2, 4, device="meta"))
    with pytest.raises(hs.HookscopeError, match="meta"):  # real inputs, meta weights
        hs.memory_profile(net, torch.randn(2, 4))


def test_reentrant_first_layer_gets_its_gradients():
    # reentrant checkpointing of a layer whose input needs no gradient gives its weights none
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(3, 4)
    assert_same_step(net, x, ["0", "2"], kind="reentrant")


def test_memory_profile_leaves_the_random_generator_as_found():
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)), torch.randn(3, 4)
    state = torch.get_rng_state()
    hs.memory_profile(net, x)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_generator_restored_for_keyword_inputs():
    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

        def forward(self, *, x):
            return self.drop(self.lin(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kw, self.out = Kw(), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(self.kw(x=x))

    torch.manual_seed(0)
    net, x = Net().cuda(), torch.randn(16, 8, device="cuda")
    assert_same_step(net, x, ["kw"])
    state = torch.cuda.get_rng_state()
    hs.memory_profile(net, x)
    assert torch.equal(torch.cuda.get_rng_state(), state)


# -- copies and pickles ---------------------------------------------------------------------------


def test_copies_and_pickles_are_plain_models():
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(3, 4)
    handle = hs.apply_checkpointing(net, ["1"])
    twin = copy.deepcopy(net)
    saved = io.BytesIO()
    torch.save(net, saved)  # while checkpointed: the model is saved without the wrapper
    handle.remove()
    assert "forward" not in twin[1].__dict__ and "__getstate__" not in twin[1].__dict__
    buf = io.BytesIO()
    torch.save(twin, buf)  # the copy outlives the handle and saves
    for blob in (buf, saved):
        blob.seek(0)
        loaded = torch.load(blob, weights_only=False)
        assert "forward" not in loaded[1].__dict__
        torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)
    assert hs.remove_hooks(twin) == 0 and "forward" not in net[1].__dict__


def test_instance_forward_is_the_one_checkpointed():
    # a forward set on the instance (as accelerate's hooks do) is run, kept by copies, put back
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(3, 4)
    own = net[1].forward = lambda t: torch.tanh(t) * 3
    want = net(x)
    with hs.apply_checkpointing(net, ["1"]):
        torch.testing.assert_close(net(x), want, rtol=0, atol=0)
        twin = copy.deepcopy(net)
    torch.testing.assert_close(twin(x), want, rtol=0, atol=0)
    assert net[1].__dict__["forward"] is own
    assert_same_step(net, x, ["1"])
