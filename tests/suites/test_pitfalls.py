"""One test (at least) per hard edge of PyTorch hooks, docs/pitfalls.md §1-14, §20-24."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs


class Sum3(nn.Module):
    def forward(self, x, y, z):
        return x + y + z


# 1. Legacy backward hooks report the last op's grads; hookscope reports every input's gradient.
def test_three_input_module_reports_three_input_grads():
    """docs/pitfalls.md §1."""
    m = Sum3()
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    w = torch.tensor([1.0, 2.0, 3.0])
    with hs.capture(m, "", inputs=True, grads=True) as cap:
        (m(*xs) * w).sum().backward()
    g = cap.last("").input_grad
    assert len(g.args) == 3
    for got in g.args:
        assert torch.equal(got, w)  # d/dx_i sum(w * (x+y+z)) = w for each input


# 2. A module that once had a legacy hook refuses full hooks: hookscope names it, and its tensor-hook
# gradient capture is unaffected.
def test_legacy_backward_hook_sticky_flag_is_reported():
    """docs/pitfalls.md §2."""
    lin = nn.Linear(3, 2)
    with pytest.warns(FutureWarning) if _legacy_warns() else _nullcontext():
        h = lin.register_backward_hook(lambda m, gi, go: None)
    h.remove()
    with (
        hs.HookScope("t") as scope,
        pytest.raises(hs.HookConflictError, match="legacy register_backward_hook"),
    ):
        scope.add_full_backward(lin, lambda m, gi, go: None, layer="")
    x = torch.randn(4, 3)
    with hs.capture(lin, "", grads=True) as cap:
        (lin(x) ** 2).sum().backward()
    out = lin(x)
    (ref,) = torch.autograd.grad((out**2).sum(), out)
    assert torch.allclose(cap.grads[""], ref)


def _legacy_warns() -> bool:
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        h = nn.Linear(1, 1).register_backward_hook(lambda *a: None)
        h.remove()
    return any(issubclass(x.category, FutureWarning) for x in w)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _conv_relu(inplace: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=inplace), nn.Conv2d(4, 2, 3))


# 3. Conv -> ReLU(inplace=True): gradient capture works and equals the out-of-place model.
def test_inplace_relu_gradients_equal_out_of_place():
    """docs/pitfalls.md §3."""
    x = torch.randn(2, 3, 9, 9)
    results = {}
    for inplace in (False, True):
        net = _conv_relu(inplace)
        with hs.capture(net, ["0", "1"], grads=True, clone=True) as cap:
            net(x).pow(2).sum().backward()
        results[inplace] = (cap["0"], cap.grads["0"], cap.grads["1"], net[0].weight.grad.clone())
    for a, b in zip(results[False], results[True]):
        assert torch.allclose(a, b, atol=1e-6)
    # and the conv output gradient is the analytic one: dL/dconv = 2*relu(y)*... via autograd
    net = _conv_relu(False)
    y = net[0](x)
    (gy,) = torch.autograd.grad(net[2](F.relu(y)).pow(2).sum(), y)
    assert torch.allclose(results[True][1], gy, atol=1e-6)


def test_inplace_modified_output_is_exact_by_default_and_zero_copy_warns():
    """docs/pitfalls.md §28."""
    net = _conv_relu(True)
    x = torch.randn(1, 3, 9, 9)
    ref = net[0](x).detach()  # what the conv returns, before the in-place ReLU
    assert (ref < 0).any()  # so the ReLU does change it
    with hs.capture(net, "0") as cap:
        net(x)
    assert torch.equal(cap["0"], ref)  # a copy: the later ReLU(inplace=True) cannot change it
    with hs.capture(net, "0", clone=False) as cap2:
        net(x)
    with pytest.warns(hs.InPlaceModifiedWarning, match=r"'0' \(call 0\).*clone=True"):
        seen = cap2["0"]
    assert torch.equal(seen, ref.clamp(min=0))  # zero-copy: the post-ReLU tensor, as warned


# 4. MultiheadAttention: identity checks (query is key) keep their path; outputs and grads unchanged.
def test_mha_outputs_and_grads_unchanged_by_hooks():
    """docs/pitfalls.md §4."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out_ref, _ = mha(x, x, x)
    (gx_ref,) = torch.autograd.grad(out_ref.sum(), x)

    seen_identity = []
    with hs.capture(mha, "", inputs=True, grads=True) as cap, hs.HookScope("probe") as probe:
        probe.add_forward_pre(
            mha, lambda m, a: seen_identity.append(a[0] is a[1] is a[2]), layer=""
        )
        out, _ = mha(x, x, x)
        (gx,) = torch.autograd.grad(out.sum(), x)
    assert seen_identity == [True]
    assert torch.equal(out, out_ref)
    assert torch.allclose(gx, gx_ref)
    assert torch.allclose(cap.grads[""][0], torch.ones_like(out))
    # the same view is used for q, k, v, so its gradient (through MHA only) equals the total one
    assert torch.allclose(cap.last("").input_grad.args[0], gx_ref, atol=1e-6)


# 5. Keyword inputs and dict outputs: every gradient is reported.
class KwDict(nn.Module):
    def forward(self, x, *, y):
        return {"a": x * y, "b": (x + 2 * y, None, "tag")}


def test_kwargs_and_dict_outputs_give_every_gradient():
    """docs/pitfalls.md §5."""
    m = KwDict()
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    with hs.capture(m, "", inputs=True, grads=True) as cap:
        out = m(x, y=y)
        (3 * out["a"].sum() + 5 * out["b"][0].sum()).backward()
    g = cap.grads[""]
    assert torch.equal(g["a"], torch.full((3,), 3.0))
    assert torch.equal(g["b"][0], torch.full((3,), 5.0))
    assert g["b"][1] is None and g["b"][2] is None
    ig = cap.last("").input_grad
    assert torch.allclose(ig.args[0], 3 * y.detach() + 5)
    assert torch.allclose(ig.kwargs["y"], 3 * x.detach() + 10)
    assert set(cap.inputs[""].kwargs) == {"y"}


# 6. No gradient flows: no exception in the hook; a clear "no gradient", never a fake zero.
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_gradient_is_reported_not_faked(mode):
    """docs/pitfalls.md §6."""
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with (
        hs.capture(net, ["0"], grads=True) as cap,
        ctx,
        pytest.warns(hs.HookscopeWarning, match=mode),
    ):
        net(torch.randn(2, 3))
    assert cap["0"].shape == (2, 3)
    with pytest.raises(hs.NoGradientError, match=mode):
        cap.grads["0"]
    assert "0" not in cap.grads


def test_frozen_network_reports_no_gradient():
    """docs/pitfalls.md §6."""
    net = nn.Linear(3, 3).requires_grad_(False)
    with hs.capture(net, "", grads=True) as cap:
        net(torch.randn(2, 3))
    with pytest.raises(hs.NoGradientError, match="required grad"):
        cap.grads[""]
    assert net.weight.requires_grad is False


# 7. Parameter gradients are edited before accumulation; the reported .grad is the edited one.
def test_parameter_grad_edit_equals_p_grad():
    """docs/pitfalls.md §7."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    net(x).pow(2).sum().backward()
    plain = net.weight.grad.clone()
    net.zero_grad()
    with hs.clip_grads(net, max_norm=0.5):
        net(x).pow(2).sum().backward()
    assert torch.allclose(net.weight.grad, plain * (0.5 / (plain.norm() + 1e-6)).clamp(max=1))
    assert net.weight.grad.norm() <= 0.5 + 1e-5


# 8. A module called via .forward() never fires: hookscope says so.
def test_layers_that_never_fire_are_reported():
    """docs/pitfalls.md §8."""
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    with hs.capture(mha, ["", "out_proj"]) as cap:
        mha(x, x, x)
    assert cap.missing == ["out_proj"]
    assert list(cap) == [""]
    with pytest.raises(hs.LayerNotRunError, match="never called"):
        cap["out_proj"]
    with (
        pytest.raises(hs.LayerNotRunError, match="never ran"),
        hs.capture(mha, ["out_proj"], stop=True),
    ):
        mha(x, x, x)


# 9. A reused module: every call kept, in order, each with its own gradient.
class Reuse(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(3, 3), nn.Linear(3, 3), nn.ReLU()

    def forward(self, x):
        return self.b(self.relu(self.a(x))).relu().mul(2).add(self.relu(x)).sum()


def test_reused_module_calls_are_paired_with_their_own_grads():
    """docs/pitfalls.md §9."""
    torch.manual_seed(0)
    m = Reuse()
    x = torch.randn(4, 3, requires_grad=True)
    with hs.capture(m, "relu", grads=True) as cap:
        m(x).backward()
    calls = cap.calls("relu")
    assert [c.index for c in calls] == [0, 1]
    # reference: the two ReLU outputs as explicit tensors
    r1 = F.relu(m.a(x))
    r2 = F.relu(x)
    loss = m.b(r1).relu().mul(2).add(r2).sum()
    g1, g2 = torch.autograd.grad(loss, [r1, r2])
    assert torch.allclose(calls[0].output, r1) and torch.allclose(calls[1].output, r2)
    assert torch.allclose(calls[0].grad, g1) and torch.allclose(calls[1].grad, g2)
    assert not torch.allclose(g1, g2)


# 10. model(x=t): keyword inputs are captured (a plain hook would see args == ()).
def test_keyword_only_call_inputs_are_recorded():
    """docs/pitfalls.md §10."""

    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    m = KW()
    t = torch.randn(1, 2)
    with hs.capture(m, "", inputs=True) as cap:
        m(x=t)
    assert cap.inputs[""].args == ()
    assert torch.equal(cap.inputs[""].kwargs["x"], t)


# 11. A hook's non-None return replaces the output: observe ignores return values; edit validates.
def test_observe_ignores_return_values_and_edit_validates():
    """docs/pitfalls.md §11."""
    net = nn.Sequential(nn.Linear(2, 2))
    x = torch.randn(3, 2, requires_grad=True)
    ref = net(x)
    grads = []
    with hs.observe(net, "0", lambda call: call.output.register_hook(grads.append)):
        out = net(x)
        out.sum().backward()
    assert torch.equal(out, ref) and len(grads) == 1
    with (
        hs.edit(net, {"0": lambda o: o.register_hook(print)}),
        pytest.raises(TypeError, match="RemovableHandle"),
    ):
        net(x)


# 12. A scope removed during a call: no error, the rest of that pass and later passes run unhooked.
def test_scope_removed_or_opened_mid_call_acts_from_the_next_layer_call():
    """docs/pitfalls.md §12."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(1, 2)
    ref = net(x)
    edits = hs.edit(net, {"2": hs.ops.zero()})
    with (
        pytest.warns(hs.HookscopeWarning, match="'2' never ran"),  # removed before it acted
        hs.observe(net, "0", lambda call: edits.remove()),
    ):
        out = net(x)
    assert torch.equal(out, ref)  # layer 2's edit was removed before layer 2 ran
    assert hs.hooks_on(net) == []
    # a capture opened during a call records from the next call on
    caps = []
    with hs.observe(net, "0", lambda call: caps.append(hs.capture(net, ["0", "1"]))):
        net(x)
    cap = caps[0]
    assert list(cap) == ["1"]  # layer 0 had already run when the scope was opened
    cap.remove()


# 13. Global hooks run first and belong to others: hookscope sees their effect and leaves them.
def test_global_hooks_coexist_with_ours():
    """docs/pitfalls.md §13."""
    net = nn.Sequential(nn.Linear(2, 2))
    h = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 0 if isinstance(m, nn.Linear) else None
    )
    try:
        with hs.capture(net, "0") as cap:
            out = net(torch.randn(1, 2))
        assert torch.equal(cap["0"], torch.zeros(1, 2)) and torch.equal(out, torch.zeros(1, 2))
        infos = [i for i in hs.hooks_on(net) if i.kind == "global_forward"]
        assert len(infos) == 1 and infos[0].owner == "other"
        assert hs.remove_hooks(net) == 0
    finally:
        h.remove()


# 14. Exceptions inside forward: state is released; the error names the layer.
class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.bad = nn.Linear(3, 3)

    def forward(self, x):
        return self.bad(self.ok(x))


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_exception_releases_hooks(exc_type):
    """docs/pitfalls.md §14."""
    m = Fails()
    if exc_type is KeyboardInterrupt:

        def interrupt(call):
            raise KeyboardInterrupt

        with (
            pytest.raises(KeyboardInterrupt),
            hs.capture(m, ["ok", "bad"]),
            hs.observe(m, "ok", interrupt),
        ):
            m(torch.randn(2, 4))
    else:
        with (
            pytest.raises(RuntimeError) as info,
            hs.capture(m, ["ok", "bad"]),
            hs.trace(m, file=io.StringIO()),
        ):
            m(torch.randn(2, 4))
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "'bad' (Linear)" in notes and "(2, 4)" in notes
    assert hs.hooks_on(m) == []
    # the trace's per-call state was released: a fresh trace on the same model works
    buf = io.StringIO()
    m.bad = nn.Linear(4, 4)
    with hs.trace(m, file=buf):
        m(torch.randn(2, 4))
    assert buf.getvalue().count("\n") == 4  # the header and three calls


# 20. Stored activations are detached: 100 iterations keep memory flat.
def test_hundred_iterations_keep_memory_flat():
    """docs/pitfalls.md §20."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def live_tensor_bytes() -> int:
        total = 0
        for o in gc.get_objects():
            if type(o) is torch.Tensor:  # plain tensors (activations, grads); not parameters
                total += o.untyped_storage().nbytes()
        return total

    with hs.capture(net, ["0", "2"], grads=True, keep="last") as cap:
        sizes = []
        for i in range(100):
            out = net(torch.randn(32, 64))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i in (10, 99):
                gc.collect()
                sizes.append(live_tensor_bytes())
            assert cap["0"].grad_fn is None
    del out
    assert sizes[1] <= sizes[0]


# 21. Hooks never keep the model alive: freed by refcount alone, even while a scope is open.
def test_model_freed_without_gc():
    """docs/pitfalls.md §21."""
    gc.disable()
    try:
        net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        ref = weakref.ref(net)
        cap = hs.capture(net, ["0", "1"], grads=True)
        ed = hs.edit(net, {"1": hs.ops.scale(2.0)})
        tr = hs.trace(net, file=io.StringIO())
        net(torch.randn(1, 2, requires_grad=True)).sum().backward()
        del net
        assert ref() is None, "the model outlived `del` (a reference cycle through a hook)"
        for s in (cap, ed, tr):
            s.remove()
        assert cap["0"].shape == (1, 2)
    finally:
        gc.enable()


# 22. Other libraries' hooks survive hookscope's cleanup; hooks_on lists all of them.
def test_remove_hooks_only_removes_ours():
    """docs/pitfalls.md §22."""
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    theirs = [
        net[0].register_forward_hook(lambda m, i, o: None),
        net[1].register_forward_pre_hook(lambda m, i: None),
    ]
    net[0].weight.register_hook(lambda g: None)
    hs.capture(net, ["0", "1"], inputs=True)  # deliberately not closed
    hs.clip_grads(net, value=1.0)
    infos = hs.hooks_on(net)
    assert {i.owner for i in infos} == {"hookscope", "other"}
    assert sum(i.owner == "other" for i in infos) == 3
    # capture: 4; clip_grads: 2 parameter hooks, 2 post-accumulate-grad hooks (noticing
    # accumulation) + 1 on the model that checks they fired
    assert hs.remove_hooks(net) == sum(i.owner == "hookscope" for i in infos) == 9
    left = hs.hooks_on(net)
    assert len(left) == 3 and all(i.owner == "other" for i in left)
    for h in theirs:
        h.remove()
    net[0].weight._backward_hooks.clear()
    assert hs.hooks_on(net) == []


# 23. deepcopy and torch.save work with hookscope attached; copies do not write into our store.
def test_deepcopy_and_save_with_hooks_attached(tmp_path):
    """docs/pitfalls.md §23."""
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    x = torch.randn(1, 2)
    with hs.capture(net, ["0"]) as cap:
        clone = copy.deepcopy(net)
        clone(x)
        assert list(cap) == []  # the copy's hooks are inert
        torch.save(net, tmp_path / "m.pt")
        pickle.dumps(net)
        net(x)
        assert len(cap.calls("0")) == 1
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(loaded(x), net(x))
    assert {i.feature for i in hs.hooks_on(clone)} == {"capture (inert copy)"}
    assert hs.remove_hooks(clone) == 1 and hs.remove_hooks(loaded) == 1


# 24. Gradient edits return new tensors: the caller's backward(gradient=g0) is not modified.
def test_grad_edit_does_not_modify_callers_gradient():
    """docs/pitfalls.md §24."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Identity())
    x = torch.randn(2, 3, requires_grad=True)
    g0 = torch.ones(2, 3)
    keep = g0.clone()
    for op in (
        hs.ops.scale(3.0),
        hs.ops.clamp(max=0.5),
        hs.ops.zero(),
        hs.ops.add(1.0),
        hs.ops.clip_norm(0.1),
    ):
        with hs.edit_grads(net, {"1": op}):
            net(x).backward(gradient=g0)
        assert torch.equal(g0, keep), op


# 27 (bonus, used by the monitor): activation checkpointing does not double count.
def test_checkpoint_recompute_is_not_double_counted():
    """docs/pitfalls.md §27."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x, ckpt=False):
            return checkpoint(self.inner, x, use_reentrant=False) if ckpt else self.inner(x)

    m = Outer()
    x = torch.randn(2, 4, requires_grad=True)
    got = {}
    for ckpt in (False, True):
        with hs.capture(m, ["inner.0", "inner.2"], grads=True) as cap:
            m(x, ckpt=ckpt).pow(2).sum().backward()
        got[ckpt] = (len(cap.calls("inner.0")), cap.grads["inner.0"])
    assert got[True][0] == got[False][0] == 1
    assert torch.allclose(got[True][1], got[False][1])


class _Counting(nn.Module):
    """A forward that reassigns one buffer and changes another in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("total", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # a new tensor replaces the buffer
        self.total.add_(x.detach().sum(0))  # in place
        return self.fc(x)


def test_summary_puts_back_reassigned_and_in_place_changed_buffers():
    net = _Counting().eval()
    calls, total = net.calls, net.total
    hs.summary(net, torch.ones(3, 2))
    assert net.calls is calls and net.total is total  # the same tensors, registered again
    assert net.calls.item() == 0 and net.total.tolist() == [0.0, 0.0]
    assert dict(net.named_buffers())["calls"] is calls
