"""Scopes own their hooks: removal on exit / exception / KeyboardInterrupt, idempotent, nested."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.core._scope import _Hook


def _net():
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def test_nested_scopes_remove_only_their_own():
    net = _net()
    x = torch.randn(1, 2)
    with hs.capture(net, ["0", "2"]) as outer:
        with hs.capture(net, "0", inputs=True) as inner, hs.edit(net, {"1": hs.ops.scale(2.0)}):
            assert len(hs.hooks_on(net)) == 2 + 2 + 1
            net(x)
        assert [(i.kind, i.layer, i.feature) for i in hs.hooks_on(net)] == [
            ("forward", "0", "capture"),
            ("forward", "2", "capture"),
        ]
        net(x)
    assert hs.hooks_on(net) == []
    assert len(outer.calls("0")) == 2 and len(inner.calls("0")) == 1


def test_remove_is_idempotent_and_scope_rejects_new_hooks():
    net = _net()
    scope = hs.edit(net, {"0": hs.ops.zero()})
    with pytest.warns(hs.HookscopeWarning, match="'0' never ran"):  # the edit never acted
        scope.remove()
    scope.remove()
    with pytest.raises(hs.ScopeReusedError, match="was closed"), scope:
        pass
    assert hs.hooks_on(net) == []
    with pytest.raises(RuntimeError, match="was removed"):
        scope.add_forward(net, lambda m, i, o: None, layer="")


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
def test_hooks_removed_on_exception_and_interrupt(exc):
    net = _net()
    with (
        pytest.raises(type(exc)),
        hs.capture(net, "*", grads=True),
        hs.edit_grads(net, {"0.weight": hs.ops.zero()}),
    ):
        net(torch.randn(1, 2)).sum().backward()
        raise exc
    assert hs.hooks_on(net) == []


def test_scope_without_with_stays_until_removed():
    net = _net()
    handle = hs.clip_grads(net, value=0.1)
    # a tensor hook per parameter, a post-accumulate-grad hook per parameter (that notices
    # gradient accumulation), and a forward hook on the model that checks they fired
    assert {i.kind for i in hs.hooks_on(net)} == {"tensor", "post_accumulate_grad", "forward"}
    assert handle.num_hooks == 9
    with pytest.warns(hs.HookscopeWarning, match="no parameter got a gradient"):
        handle.remove()  # (no backward ran: nothing was clipped, and it says so)
    assert hs.hooks_on(net) == []


def test_activation_grad_hooks_are_inert_after_exit():
    net = _net()
    x = torch.randn(1, 2)
    with (
        pytest.warns(hs.HookscopeWarning, match="'2' got no gradient while the scope was open"),
        hs.edit_grads(net, {"2": hs.ops.zero()}),
    ):
        out = net(x)  # grad hook registered on this graph
    out.sum().backward()  # after the scope: no edit applied
    assert torch.equal(net[2].bias.grad, torch.ones(2))  # would be zeros had the edit applied


def test_torchscript_and_compiled_models_are_refused():
    net = _net()
    with pytest.warns(FutureWarning, match="deprecated"):
        scripted = torch.jit.script(net)
    with pytest.raises(hs.UnsupportedModelError, match="TorchScript"):
        hs.capture(scripted, "0")

    class FakeCompiled(nn.Module):  # same shape as torch._dynamo's OptimizedModule
        def __init__(self, m):
            super().__init__()
            self._orig_mod = m

    FakeCompiled.__name__ = "OptimizedModule"
    with pytest.raises(hs.UnsupportedModelError, match="no Dynamo context found"):
        hs.edit(FakeCompiled(net), {"0": hs.ops.zero()})


def test_torch_compile_orig_mod_names_point_to_the_eager_name():
    net = _net()
    compiled = torch.compile(net)
    with pytest.raises(hs.LayerNotFoundError, match=r"without '_orig_mod'; use '0'"):
        hs.capture(compiled, "_orig_mod.0")


def test_hooks_on_reports_kinds_and_legacy_hooks():
    net = _net()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = net[2].register_backward_hook(lambda m, gi, go: None)
    h2 = net[0].register_full_backward_pre_hook(lambda m, go: None)
    with hs.capture(net, "1", inputs=True):
        kinds = sorted((i.kind, i.layer, i.owner) for i in hs.hooks_on(net))
    assert kinds == [
        ("backward_pre", "0", "other"),
        ("forward", "1", "hookscope"),
        ("forward_pre", "1", "hookscope"),
        ("legacy_backward", "2", "other"),
    ]
    h.remove()
    h2.remove()


def test_many_forward_hooks_at_once_behave_like_registered_ones():
    """add_forward_many (what capture uses) keeps PyTorch's order, is listed, removes only its own,
    and goes through the public method for a module class that overrides it."""
    calls = []

    class Custom(nn.Linear):
        def register_forward_hook(self, hook, **kw):  # e.g. a wrapper library's own bookkeeping
            calls.append("custom")
            return super().register_forward_hook(hook, **kw)

    net = nn.Sequential(nn.Linear(2, 2), Custom(2, 2))
    order = []
    before = net[0].register_forward_hook(lambda m, i, o: order.append("before"))
    scope = hs.HookScope("many")
    hooks = [_Hook(lambda m, i, o, n=n: order.append(n), "", "", "", 0) for n in ("0", "1")]
    scope.add_forward_many((net[int(n)], h, n) for n, h in zip(("0", "1"), hooks))
    after = net[0].register_forward_hook(lambda m, i, o: order.append("after"))
    assert calls == ["custom"] and scope.num_hooks == 2
    assert {(h.layer, h.feature) for h in hs.hooks_on(net) if h.owner == "hookscope"} == {
        ("0", "many"),
        ("1", "many"),
    }
    net(torch.zeros(1, 2))
    assert order == ["before", "0", "after", "1"]
    scope.remove()
    scope.remove()  # idempotent
    order.clear()
    net(torch.zeros(1, 2))
    assert order == ["before", "after"] and scope.num_hooks == 0
    before.remove()
    after.remove()
    assert hs.hooks_on(net) == []


def test_many_pre_and_always_called_hooks_behave_like_registered_ones():
    """add_forward_many(pre=True) and (always_call=True), what memory_profile places on every
    module: same order of calls as the public methods, the always-called hook runs when forward
    raises, all listed, all removed."""
    calls: list[str] = []

    class Rec(_Hook):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, *args):
            calls.append(self.tag)

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = nn.Sequential(nn.Linear(2, 2), Boom())
    scope = hs.HookScope("test")
    scope.add_forward_many([(net[0], Rec("pre0"), "0"), (net[1], Rec("pre1"), "1")], pre=True)
    scope.add_forward_many(
        [(net[0], Rec("post0"), "0"), (net[1], Rec("post1"), "1")], always_call=True
    )
    assert sorted((h.kind, h.layer) for h in hs.hooks_on(net)) == [
        ("forward", "0"),
        ("forward", "1"),
        ("forward_pre", "0"),
        ("forward_pre", "1"),
    ]
    with pytest.raises(RuntimeError, match="boom"):
        net(torch.randn(1, 2))
    assert calls == ["pre0", "post0", "pre1", "post1"]  # post1 ran though Boom raised
    scope.remove()
    assert hs.hooks_on(net) == [] and not net[1]._forward_hooks_always_called
    calls.clear()
    net[0](torch.randn(1, 2))
    assert calls == []


def test_many_hooks_prepended_run_before_the_module_s_own_as_registered_ones():
    """add_forward_many(prepend=True), what hs.compare's call boundaries use: each hook runs
    before the hooks the module already has (on the bulk path and on the public one), as
    ``register_forward_pre_hook(prepend=True)`` does, and is removed with the scope."""
    order: list[str] = []

    class Custom(nn.Linear):
        def register_forward_pre_hook(self, hook, **kw):  # the public path
            return super().register_forward_pre_hook(hook, **kw)

    net = nn.Sequential(nn.Linear(2, 2), Custom(2, 2))
    own = [m.register_forward_pre_hook(lambda m, i, n=n: order.append(f"own{n}")) for n, m in
           enumerate(net)]  # fmt: skip
    scope = hs.HookScope("test")
    hooks = [_Hook(lambda m, i, n=n: order.append(f"mine{n}"), "", "", "", 0) for n in (0, 1)]
    scope.add_forward_many([(net[n], hooks[n], str(n)) for n in (0, 1)], pre=True, prepend=True)
    net(torch.zeros(1, 2))
    assert order == ["mine0", "own0", "mine1", "own1"]
    scope.remove()
    order.clear()
    net(torch.zeros(1, 2))
    assert order == ["own0", "own1"]
    for h in own:
        h.remove()
    assert hs.hooks_on(net) == []


def _scope_kinds():
    """Every kind of scope a user enters with ``with``, made on a fresh net (name, factory)."""
    return {
        "capture": lambda net: hs.capture(net, "0"),
        "edit": lambda net: hs.edit(net, {"0": hs.ops.zero()}),
        "edit_grads": lambda net: hs.edit_grads(net, {"0": hs.ops.scale(2.0)}),
        "clip_grads": lambda net: hs.clip_grads(net, value=1.0),
        "trace": lambda net: hs.trace(net, file=io.StringIO()),
        "steer": lambda net: hs.steer(net, {"0": torch.ones(3)}),
        "tensor_grads": lambda net: hs.tensor_grads(torch.ones(1, requires_grad=True) * 2),
        "Monitor": lambda net: hs.Monitor(net),
        "apply_checkpointing": lambda net: hs.apply_checkpointing(net, ["0"]),
    }


@pytest.mark.parametrize("kind", list(_scope_kinds()))
def test_every_scope_kind_refuses_a_second_with(kind):
    """A scope is single-use: a second ``with`` on the same object (after it closed, or nested
    inside its first) raises instead of running the model without its hooks."""
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    scope = _scope_kinds()[kind](net)
    with scope:
        net(torch.ones(2, 3)).sum().backward()
        with pytest.raises(hs.ScopeReusedError, match="already open"), scope:
            pass
    with pytest.raises(hs.ScopeReusedError, match=f"hs.{kind}\\("), scope:
        net(torch.ones(2, 3))
    assert hs.hooks_on(net) == []


def test_many_hooks_with_kwargs_get_them_as_the_public_methods_give_them():
    """add_forward_many(with_kwargs=True), pre and post: the hooks get the call's keyword
    arguments exactly as hooks registered with the public methods do (what they return replaces
    args and kwargs, or the output), and nothing is left once removed."""

    class Kw(nn.Module):
        def forward(self, x, *, scale=1.0):
            return x * scale

    seen: dict[str, list] = {"many": [], "public": []}

    class Pre(_Hook):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, module, args, kwargs):
            seen[self.tag].append(("pre", kwargs.get("scale")))
            return args, {**kwargs, "scale": kwargs["scale"] * 2}

    class Post(_Hook):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, module, args, kwargs, out):
            seen[self.tag].append(("post", kwargs.get("scale")))
            return out + 1

    outs = {}
    x = torch.ones(2)
    for tag in ("many", "public"):
        m = Kw()
        scope = hs.HookScope("test")
        if tag == "many":
            scope.add_forward_many([(m, Pre(tag), "m")], pre=True, with_kwargs=True)
            scope.add_forward_many([(m, Post(tag), "m")], with_kwargs=True)
        else:
            scope.add_forward_pre(m, Pre(tag), layer="m", with_kwargs=True)
            scope.add_forward(m, Post(tag), layer="m", with_kwargs=True)
        outs[tag] = m(x, scale=3.0)
        scope.remove()
        assert hs.hooks_on(m) == [] and not m._forward_pre_hooks_with_kwargs
        assert not m._forward_hooks_with_kwargs
        assert torch.equal(m(x, scale=3.0), x * 3.0)
    assert seen["many"] == seen["public"] == [("pre", 3.0), ("post", 6.0)]
    assert torch.equal(outs["many"], outs["public"]) and torch.equal(outs["many"], x * 6.0 + 1)


def test_a_view_gradient_hook_gets_what_a_plain_tensor_hook_gets():
    """add_view_grad_hook (a pre-hook of the identity view's backward node): the gradient equals
    a plain ``register_hook`` on the same value; a view changed in place loses it, as PyTorch
    drops a tensor hook there."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    want, got, lost = [], [], []
    y = x @ w
    y.register_hook(lambda g: want.append(g.clone()))
    (y.tanh() * 2).sum().backward()
    scope = hs.HookScope("test")
    y = x @ w
    v = y.view_as(y)
    scope.add_view_grad_hook(v, lambda g: got.append(g.clone()))
    (v.tanh() * 2).sum().backward()
    assert len(got) == 1 and torch.equal(got[0], want[0])
    y = x @ w
    v = y.view_as(y)
    scope.add_view_grad_hook(v, lambda g: lost.append(g))
    v.mul_(2)
    v.sum().backward()
    assert lost == []
    scope.remove()


def test_node_hooks_see_the_gradients_a_node_gets_and_gives():
    """add_node_hook: a pre-hook on the node that made ``h`` gets ``h``'s gradient (even after
    a view of ``h`` was changed in place, which drops the view's own hooks), a hook on the
    in-place node gets what it gives its input and what it got, as ``torch.autograd.grad``
    computes them on the same graph written without the in-place op."""
    w = torch.randn(4, requires_grad=True)
    scope = hs.HookScope("test")
    got: dict[str, torch.Tensor] = {}
    h = w * 2
    scope.add_node_hook(h.grad_fn, lambda go: got.update(h=go[0].clone()), pre=True)
    v = h.view_as(h)
    s = h * 3  # a use before the change
    torch.relu_(v)
    scope.add_node_hook(
        h.grad_fn, lambda gi, go: got.update(into=gi[0].clone(), out=go[0].clone()), pre=False
    )
    (v * torch.arange(4.0)).sum().add(s.sum()).backward()
    w2 = w.detach().clone().requires_grad_(True)
    h2 = w2 * 2
    r2 = torch.relu(h2)
    g_h, g_r = torch.autograd.grad((r2 * torch.arange(4.0)).sum() + (h2 * 3).sum(), [h2, r2])
    torch.testing.assert_close(got["h"], g_h, rtol=0, atol=0)
    torch.testing.assert_close(got["out"], g_r, rtol=0, atol=0)
    torch.testing.assert_close(got["into"], g_r * (h2 > 0), rtol=0, atol=0)
    scope.remove()
