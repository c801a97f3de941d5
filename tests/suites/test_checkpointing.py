"""Hooks exact under activation checkpointing (docs/pitfalls.md §27): every feature x every checkpoint kind
gives the values, call counts and records of the run without checkpointing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import hookscope as hs


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Block(), Block(), Block(), nn.Linear(8, 2))


KINDS = ["none", "non_reentrant", "reentrant", "selective", "compiled"]
BLOCKS = ["1", "2", "3"]
X = torch.randn(5, 4)


def prepare(net: nn.Module, kind: str):
    """(model to run, handle) for a checkpoint kind around each block."""
    if kind == "none":
        return net, None
    if kind == "compiled":
        handle = hs.apply_checkpointing(net, BLOCKS)
        torch._dynamo.reset()
        return torch.compile(net, backend="eager"), handle
    policy = [torch.ops.aten.addmm.default] if kind == "selective" else None
    return net, hs.apply_checkpointing(net, BLOCKS, kind=kind, policy=policy)


def run_feature(feature: str, kind: str):
    """What a user reads from ``feature`` after one training step under ``kind``."""
    net = make_net()
    model, handle = prepare(net, kind)
    try:
        return FEATURES[feature](net, model)
    finally:
        if handle is not None:
            handle.remove()


def f_capture(net, model):
    with hs.capture(model, ["1.fc1", "2.act", "3", "4"], grads=True) as cap:
        model(X).sum().backward()
    out = {}
    for n in cap.layers:
        calls = cap.calls(n)
        out[n] = [(c.output, c.grad) for c in calls]
    return out


def f_capture_inputs(net, model):
    with hs.capture(model, ["2.fc2", "3"], inputs=True, grads=True) as cap:
        model(X).sum().backward()
    return {
        n: [(c.inputs.args[0], c.input_grad[0][0], c.grad) for c in cap.calls(n)]
        for n in cap.layers
    }


def f_edit(net, model):
    with hs.edit(model, {"2.act": hs.ops.scale(2.0), "3.fc1": hs.ops.add(0.5)}):
        y = model(X)
        y.sum().backward()
    return {"y": y.detach(), **{n: p.grad for n, p in net.named_parameters()}}


def f_edit_grads(net, model):
    calls = []

    def halve(g):
        calls.append(1)
        return g * 0.5

    with hs.edit_grads(model, {"2.fc1": halve, "1.fc2.weight": hs.ops.scale(3.0)}):
        model(X).sum().backward()
    return {"calls": len(calls), **{n: p.grad for n, p in net.named_parameters()}}


def f_clip_grads(net, model):
    with hs.clip_grads(model, value=0.05):
        model(X).sum().backward()
    return {n: p.grad for n, p in net.named_parameters()}


def f_monitor(net, model):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = hs.Monitor(model, alerts="off")
    try:
        model(X).sum().backward()
        opt.step()
        rec = mon.step(opt)
    finally:
        mon.close()
    return {"layers": rec.layers, "params": rec.params}


def f_sentinel(net, model):
    with torch.no_grad():
        net[3].fc1.bias[2] = math.nan  # the first NaN is made by layer 3.fc1
    mon = hs.Monitor(model, sentinel=True, alerts="off", stats=())
    try:
        model(X).sum().backward()
        rec = mon.step()
    finally:
        mon.close()
    o = rec.nonfinite
    return {"origin": (o.layer, o.phase, o.call, o.kind)}


def f_sentinel_backward(net, model):
    # a NaN made in backward: the gradient of 2.fc1's output, replaced by NaN
    mon = hs.Monitor(model, sentinel=True, alerts="off", stats=())
    try:
        with hs.edit_grads(model, {"2.act": lambda g: g * math.nan}):
            model(X).sum().backward()
        rec = mon.step()
    finally:
        mon.close()
    o = rec.nonfinite
    return {"origin": (o.layer, o.phase, o.call, o.kind)}


FEATURES = {
    "capture": f_capture,
    "capture_inputs": f_capture_inputs,
    "edit": f_edit,
    "edit_grads": f_edit_grads,
    "clip_grads": f_clip_grads,
    "monitor": f_monitor,
    "sentinel": f_sentinel,
    "sentinel_backward": f_sentinel_backward,
}
_reference: dict[str, object] = {}


def reference(feature: str):
    if feature not in _reference:
        _reference[feature] = run_feature(feature, "none")
    return _reference[feature]


@pytest.mark.parametrize("kind", KINDS[1:])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_exact_under_checkpointing(feature, kind):
    if feature == "sentinel_backward" and kind == "reentrant":
        # what cannot work says so: the reentrant forward runs under no_grad
        with pytest.warns(
            hs.HookscopeWarning, match=r"layer '1.act'.*reentrant.*use_reentrant=False"
        ):
            got = run_feature(feature, kind)
        assert got["origin"] != reference(feature)["origin"]
        return
    if feature == "sentinel" and kind == "reentrant":
        with pytest.warns(hs.HookscopeWarning, match="reentrant"):
            got = run_feature(feature, kind)
        assert same(got, reference(feature))
        return
    got, want = run_feature(feature, kind), reference(feature)
    assert same(got, want), f"{feature} under {kind} checkpointing: {got} != {want}"


def same(a, b) -> bool:
    """Equal values (tensors to fp32 rounding, NaN equal to NaN), same structure and counts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


def test_reference_has_content():
    # the run without checkpointing reads real values: every captured layer has one call with a
    # gradient, the edit of gradients ran once, the sentinel names the layer that made the NaN
    cap = reference("capture")
    assert all(len(v) == 1 and v[0][1] is not None for v in cap.values())
    assert reference("edit_grads")["calls"] == 1
    assert reference("sentinel")["origin"] == ("3.fc1", "forward", 0, "nan")
    # and the captured gradient of 2.act is torch.autograd.grad's, by a hand-written forward
    net = make_net()
    b = net[2]
    h1 = net[1](net[0](X))
    a = b.act(b.fc1(h1))
    out = net[4](net[3](h1 + b.fc2(a)))
    (g,) = torch.autograd.grad(out.sum(), a)
    torch.testing.assert_close(cap["2.act"][0][1], g)
    torch.testing.assert_close(cap["2.act"][0][0], a.detach())


def test_capture_grads_reentrant_named_in_error():
    # with reentrant checkpointing and no backward yet, the error says where the gradient comes from
    net = make_net()
    with hs.apply_checkpointing(net, BLOCKS, kind="reentrant"):
        with hs.capture(net, ["2.act"], grads=True) as cap:
            net(X)
        with pytest.raises(hs.NoGradientError, match="reentrant"):
            cap.grads["2.act"]


def test_deepcopy_and_pickle_of_checkpointed_model():
    # a copy or a pickle of a checkpointed model is the plain model (as hookscope's hooks become
    # inert in copies): it outlives the handle, saves, and computes what the original does
    import io

    net = make_net()
    with hs.apply_checkpointing(net, BLOCKS):
        twin = copy.deepcopy(net)
        blob = io.BytesIO()
        torch.save(net, blob)
        assert all("forward" in net[int(b)].__dict__ for b in BLOCKS)  # still checkpointed
    assert "forward" not in net[1].__dict__ and "__getstate__" not in net[1].__dict__
    assert "forward" not in twin[1].__dict__
    blob.seek(0)
    loaded = torch.load(blob, weights_only=False)
    for other in (twin, loaded):
        assert all("forward" not in other[int(b)].__dict__ for b in BLOCKS)
        torch.testing.assert_close(other(X), net(X), rtol=0, atol=0)
        torch.save(other, io.BytesIO())


def test_apply_checkpointing_after_compile_refused():
    net = make_net()
    compiled = torch.compile(net, backend="eager")
    with pytest.raises(hs.HookscopeError, match=r"layer '2'.*before compiling"):
        hs.apply_checkpointing(compiled, ["2"])
    assert "forward" not in net[2].__dict__


@pytest.mark.parametrize("kind", ["non_reentrant", "reentrant"])
def test_module_shared_by_checkpointed_blocks(kind):
    # one Tanh called in three checkpointed blocks: three calls, each paired with its own
    # recompute (backward recomputes the blocks in reverse order)
    def run(kind):
        net = make_net()
        shared = nn.Tanh()
        for i in BLOCKS:
            net[int(i)].act = shared
        handle = hs.apply_checkpointing(net, BLOCKS, kind=kind) if kind else None
        try:
            with hs.capture(net, ["1.act"], grads=True) as cap:
                net(X).sum().backward()
        finally:
            if handle is not None:
                handle.remove()
        return [(c.output, c.grad) for c in cap.calls("1.act")]

    got, want = run(kind), run(None)
    assert len(want) == 3 and not torch.allclose(want[0][1], want[2][1])
    assert same(got, want)


class Checkpointed(nn.Module):
    """block -> tanh -> head, the block checkpointed as ``ck`` says ("none", "non_reentrant",
    "reentrant": torch.utils.checkpoint in forward, as Transformers'
    gradient_checkpointing_enable() does; "apply": hs.apply_checkpointing)."""

    def __init__(self, ck: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)
        self.ck = ck

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ck in ("non_reentrant", "reentrant"):
            h = torch.utils.checkpoint.checkpoint(
                self.block, x, use_reentrant=self.ck == "reentrant"
            )
        else:
            h = self.block(x)
        return self.head(h.tanh())


CK_KINDS = ["non_reentrant", "reentrant", "apply"]
SCOPES = {
    "edit": lambda m: hs.edit(m, {"block.1": lambda o: o * 2}),
    "steer": lambda m: hs.steer(m, {"block.1": torch.full((8,), 3.0)}),
}


def _step(ck: str, scope: str | None, around: str):
    """One forward + backward; the scope open around both ("both"), the forward only
    ("forward") or the backward only ("backward"). Returns the parameter gradients."""
    model = Checkpointed(ck)
    handle = hs.apply_checkpointing(model, ["block"]) if ck == "apply" else None
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    try:
        if scope is None:
            model(x).sum().backward()
        elif around == "both":
            with SCOPES[scope](model):
                model(x).sum().backward()
        elif around == "forward":
            with SCOPES[scope](model):
                out = model(x)
            out.sum().backward()
        else:
            out = model(x)
            with SCOPES[scope](model):
                out.sum().backward()
    finally:
        if handle is not None:
            handle.remove()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("ck", CK_KINDS)
@pytest.mark.parametrize("scope", list(SCOPES))
def test_scope_around_forward_and_backward_gives_the_uncheckpointed_gradients(scope, ck):
    """The reference: the same step without checkpointing."""
    want = _step("none", scope, "both")
    assert not all(torch.equal(a, b) for a, b in zip(want, _step("none", None, "both")))
    for got, ref in zip(_step(ck, scope, "both"), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("ck", CK_KINDS)
@pytest.mark.parametrize("scope", list(SCOPES))
def test_scope_closed_before_a_checkpointed_backward_warns(scope, ck):
    """backward() after the with block: the recompute runs without the scope, so the gradients
    are not those of the edited forward; exit says so (without checkpointing it stays silent:
    the graph holds the edited values)."""
    with pytest.warns(
        hs.HookscopeWarning,
        match=rf"{scope}: layer\(s\) 'block.1' were edited inside activation-checkpointed code .*"
        "whose backward had not run.*call backward\\(\\) inside the with block",
    ):
        _step(ck, scope, "forward")
    want = _step("none", scope, "both")
    for got, ref in zip(_step("none", scope, "forward"), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("ck", CK_KINDS)
@pytest.mark.parametrize("scope", list(SCOPES))
def test_scope_opened_around_backward_only_does_not_edit_the_recompute(scope, ck):
    """The forward ran unedited: its recompute must not be edited either, so the gradients equal
    the plain step's (edit and steer say their layer never ran in a forward of the scope)."""
    want = _step("none", None, "both")
    with pytest.warns(hs.HookscopeWarning, match="'block.1' never ran"):
        got = _step(ck, scope, "backward")
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref)
