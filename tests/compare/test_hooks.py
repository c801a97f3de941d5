"""compare/_hooks.py: what the recording hooks keep of each call equals what plain hooks written
by hand see (clones taken in a forward pre-hook and a forward hook), including where the copies
are shared: a value kept again unchanged is held once, a value changed in place in between gets
a copy of its own."""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from helpers.common import tiny_models_on_one_thread  # noqa: F401

_run = importlib.import_module("hookscope.compare._run")


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y


class _Caller(nn.Module):
    """The caller changes a child's output in place before handing it on, hands one tensor to
    three modules and the same tensor twice to one, and a child works in place on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.twice = _Twice()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(2.0)  # changed after `a` returned it: `b` gets another value than a's output
        q, k, v = self.b(h), self.c(h), self.d(h)  # one tensor to three modules
        s = self.twice(q, q)  # the same tensor twice
        s = s + k
        self.act(s)  # in place on what it is given
        return s + v


def _by_hand(model: nn.Module, x: torch.Tensor, loss) -> tuple[dict, dict]:
    ins, outs, counts = {}, {}, {}
    handles = []
    for name, m in model.named_modules():

        def pre(mod, args, name=name):
            i = counts.get(name, 0)
            counts[name] = i + 1
            ins[(name, i)] = [t.detach().clone() for t in args]

        def post(mod, args, out, name=name):
            outs[(name, counts[name] - 1)] = out.detach().clone()

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        loss(model(x)).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return ins, outs


def test_kept_inputs_and_outputs_are_what_plain_hooks_see_and_unchanged_values_are_held_once():
    torch.manual_seed(0)
    model, x = _Caller(), torch.randn(3, 4)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    ins, outs = _by_hand(model, x, loss)
    rec = _run.record_run(_run.RunSpec(model, (x,), {}, loss))
    assert len(rec.calls) == len(outs) == 7
    for c in rec.calls:
        args, kwargs = c.inputs
        assert not kwargs and len(args) == len(ins[c.key])
        for got, want in zip(args, ins[c.key]):
            assert torch.equal(got, want), c.key
        assert torch.equal(c.output, outs[c.key]), c.key
    by = {c.key: c for c in rec.calls}
    # the in-place ReLU's input was kept before it changed it; its output is the changed value
    assert (by[("act", 0)].inputs[0][0] < 0).any() and (by[("act", 0)].output >= 0).all()
    # held once: one input to three modules, the same tensor twice, an output handed on
    hb, hc, hd = (by[(n, 0)].inputs[0][0] for n in "bcd")
    assert hb is hc is hd
    q1, q2 = by[("twice", 0)].inputs[0]
    assert q1 is q2 is by[("b", 0)].output
    # ... but not a value changed in place in between: a's output and b's input differ
    assert not torch.equal(by[("a", 0)].output, hb)
    assert by[("a", 0)].output is not hb


def test_under_inference_mode_every_value_is_a_copy_of_its_own():
    """Inference tensors have no version counter: nothing is shared, the values are still
    those plain hooks see."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with torch.inference_mode():
        want = [x, model[0](x), model[1](model[0](x))]
        rec = _run.record_run(_run.RunSpec(model, (x,), {}))
    got = {c.key: c for c in rec.calls}
    for i, w in enumerate(want):
        assert torch.equal(got[(str(i), 0)].inputs[0][0], w)
    assert got[("1", 0)].inputs[0][0] is not got[("0", 0)].output


class _Recache(nn.Module):
    """A cache buffer re-registered at another length in forward (as rotary embeddings did), a
    buffer added, a running count updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.register_buffer("cache", torch.arange(float(x.shape[0])), persistent=False)
        self.register_buffer("extra", torch.ones(1))
        self.count += 1
        return self.lin(x) + self.cache[:, None]


def test_compare_leaves_buffers_as_found_even_where_the_forward_replaces_them():
    import hookscope as hs

    torch.manual_seed(0)
    a = _Recache()
    b = _Recache()
    b.load_state_dict(a.state_dict())
    cache, count = a.cache, a.count
    before = {n: t.clone() for n, t in a.named_buffers()}
    hs.compare(a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert a.cache is cache and a.count is count and not hasattr(a, "extra")
    assert dict(a.named_buffers()).keys() == before.keys()
    for n, t in a.named_buffers():
        assert torch.equal(t, before[n]), n


def test_objects_among_the_inputs_are_kept_as_they_were_when_the_call_started():
    """A cache passed down the layers and grown by each: the value kept of each call holds it
    as that call got it (what a plain pre-hook sees), though its tensors require grad."""
    import copy

    from helpers.lm import tiny_decoder

    torch.manual_seed(0)
    m = tiny_decoder("llama")
    ids = torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        prefix = m(ids[:, :4], use_cache=True).past_key_values
    seen = {}

    def lens(cache):
        return [layer.keys.shape[2] for layer in cache.layers]

    handles = [
        m.get_submodule(f"model.layers.{k}.self_attn").register_forward_pre_hook(
            lambda mod, a, kw, k=k: seen.__setitem__(k, lens(kw["past_key_values"])),
            with_kwargs=True,
        )
        for k in range(2)
    ]
    try:
        m(ids[:, 4:], past_key_values=copy.deepcopy(prefix), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    assert seen == {0: [4, 4], 1: [7, 4]}
    kw = {"past_key_values": copy.deepcopy(prefix), "use_cache": True}
    rec = _run.record_run(_run.RunSpec(m, (ids[:, 4:],), kw, lambda o: o.logits.sum()))
    for k in range(2):
        c = rec.calls[rec.by_key[(f"model.layers.{k}.self_attn", 0)]]
        assert lens(c.inputs[1]["past_key_values"]) == seen[k]


def test_an_object_that_cannot_be_copied_is_kept_with_a_warning_naming_the_layer():
    import threading
    import warnings

    import hookscope as hs

    class Holder:
        def __init__(self) -> None:
            self.lock, self.bias = threading.Lock(), torch.ones(4)

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, holder):
            return self.lin(x) + holder.bias

    model = nn.Sequential()
    model.add_module("use", Uses())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _run.record_run(_run.RunSpec(model.use, (torch.randn(2, 4), Holder()), {}))
    msgs = [str(w.message) for w in got if issubclass(w.category, hs.HookscopeWarning)]
    assert msgs and "cannot copy a Holder" in msgs[0] and "lock" in msgs[0]


class _UsedBefore(nn.Module):
    """A module's output used by its caller before an in-place ReLU changes it, and after."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.c1, self.relu, self.c2 = nn.Linear(4, 4), nn.ReLU(inplace=inplace), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        s = h * 2.0  # a use of c1's output before the ReLU changes it
        r = self.relu(h)
        return self.c2(r) + s + h  # h: the changed value, through the caller's own reference


def test_gradients_of_values_changed_in_place_are_taken_from_the_graph_exactly(tmp_path):
    """PyTorch drops the gradient hook of a view changed in place; the record takes those
    gradients from the graph's own nodes instead: c1's output gradient (every use: before the
    change, through the ReLU, through the caller's reference), the ReLU's input gradient
    (through the ReLU only) and its output gradient (the changed value's, every use), each equal
    to the same model with ``inplace=False`` and plain tensor hooks written by hand; nothing is
    recorded as lost."""
    torch.manual_seed(0)
    model = _UsedBefore(inplace=True)
    twin = _UsedBefore(inplace=False)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    got: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(g):
            got[name] = g.clone()

        return hook

    h = twin.c1(x)
    h.register_hook(keep("c1.out"))
    s = h * 2.0
    r = twin.relu(h)
    r.register_hook(keep("relu.out"))
    out = twin.c2(r) + s + r  # the in-place model's `h` is the ReLU's output itself
    out.pow(2).sum().backward()
    want_relu_in = got["relu.out"] * (h > 0)
    rec = _run.record_run(_run.RunSpec(model, (x,), {}, lambda o: o.pow(2).sum(), None, "a", None))
    assert rec.lost == {}
    call = {c.name: c for c in rec.calls}
    # the ReLU's output gradient: c2's path, and the caller's own reference `h` (the same value)
    torch.testing.assert_close(call["relu"].grad[0], got["relu.out"], rtol=0, atol=1e-6)
    torch.testing.assert_close(call["relu"].in_grad[0], want_relu_in, rtol=0, atol=1e-6)
    torch.testing.assert_close(call["c1"].grad[0], got["c1.out"], rtol=0, atol=1e-6)


def test_a_live_b_takes_the_gradient_of_an_in_place_call_s_output_as_a_does():
    """B, live, keeps no inputs: its in-place ReLU's output gradient was the returned tensor's
    uses only while A's (taken from the in-place node) was every use of the changed value, so an
    exact copy showed a gradient error of 0.79 there; both now take it from the node."""
    import copy

    import hookscope as hs

    torch.manual_seed(0)
    model = _UsedBefore(inplace=True)
    x = torch.randn(3, 4)
    report = hs.compare(model, copy.deepcopy(model), x, loss_fn=lambda o: o.pow(2).sum())
    assert report.culprit is None and not report.notes
    assert [r.grad_error for r in report.rows] == [0.0] * len(report.rows)
