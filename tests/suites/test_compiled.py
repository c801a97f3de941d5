"""hookscope on torch.compile'd models: eager names, eager values, bounded recompiles, never silent.

References are the same weights run eagerly with hookscope (itself proven against plain hooks,
torch.autograd.grad and torchvision's FX extractor in the other test files) or with plain hooks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope as hs
from hookscope import ops

FORMS = ["wrapper", "in_place", "submodule"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    dynamo.utils.counters.clear()
    yield
    dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + x


class Net(nn.Module):
    """A reused ReLU (two calls), a residual block, a head: a custom forward, like real models."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.relu = nn.ReLU()
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.inp(x))
        h = self.relu(self.block(h))
        return self.head(h)


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def compiled(form: str, backend: str = "aot_eager", **kw):
    """(object the user calls and hands to hookscope, its eager twin, name prefix)."""
    net = make()
    eager = copy.deepcopy(net)
    if form == "wrapper":
        return torch.compile(net, backend=backend, **kw), eager, ""
    if form == "in_place":
        net.compile(backend=backend, **kw)
        return net, eager, ""
    outer, twin = nn.Module(), nn.Module()
    outer.body, twin.body = torch.compile(net, backend=backend, **kw), eager
    outer.forward = outer.body.__call__  # type: ignore[method-assign]
    twin.forward = twin.body.__call__  # type: ignore[method-assign]
    return outer, twin, "body."


X = torch.randn(5, 4)


@pytest.mark.parametrize("form", FORMS)
def test_names_are_the_uncompiled_models(form):
    cm, _, pre = compiled(form)
    want = [pre + n if n else n for n, _ in make().named_modules()]
    got = list(hs.find(cm))
    assert [n for n in got if n.startswith(pre.rstrip("."))][-len(want) + 1 :] == [
        n for n in want if n
    ]
    assert not any("_orig_mod" in n for n in got)
    assert type(hs.find(cm, pre + "block")[pre + "block"]).__name__ == "Block"
    with pytest.raises(hs.LayerNotFoundError, match=f"{pre}block"):
        hs.find(cm, pre + "blok")


@pytest.mark.parametrize("form", FORMS)
def test_capture_outputs_inputs_grads_every_call(form):
    cm, eager, pre = compiled(form)
    layers = [pre + "relu", pre + "block.fc", pre + "head"]
    x = X.clone().requires_grad_()
    cm(x)  # the compiled graph exists before hookscope comes
    with hs.capture(eager, layers, grads=True, inputs=True) as ref:
        eager(x).sum().backward()
    for _ in range(3):  # the same scope again: same values, nothing stale
        with hs.capture(cm, layers, grads=True, inputs=True) as cap:
            cm(x).sum().backward()
        for name in layers:
            assert len(cap.calls(name)) == len(ref.calls(name))
            for c, r in zip(cap.calls(name), ref.calls(name)):
                torch.testing.assert_close(c.output, r.output, rtol=0, atol=0)
                torch.testing.assert_close(c.grad, r.grad, rtol=0, atol=0)
                torch.testing.assert_close(c.inputs[0], r.inputs[0], rtol=0, atol=0)
    assert len(cap.calls(pre + "relu")) == 2  # the reused module: both calls, in order
    assert hs.hooks_on(cm) == []


def test_capture_matches_plain_hooks_and_unhooked_calls_stay_compiled():
    counter = CompileCounterWithBackend("aot_eager")
    net = make()
    cm = torch.compile(net, backend=counter)
    plain = {}
    twin = copy.deepcopy(net)
    h = twin.block.register_forward_hook(lambda m, i, o: plain.__setitem__("o", o.detach()))
    twin(X)
    h.remove()
    cm(X)
    bare_frames = counter.frame_count
    for _ in range(20):  # the same scope opened and closed 20 times
        with hs.capture(cm, ["block"]) as cap:
            cm(X)
        torch.testing.assert_close(cap["block"], plain["o"], rtol=0, atol=0)
    after_scopes = counter.frame_count
    cm(X)  # no scope: the original compiled graph, no new compile, no hook
    assert counter.frame_count == after_scopes
    assert after_scopes - bare_frames <= 3
    assert dynamo.utils.counters["stats"]["unique_graphs"] <= 1 + 3


def test_stop_ends_the_compiled_forward_early():
    cm, eager, _ = compiled("wrapper")
    fx = hs.FeatureExtractor(cm, ["block"])
    ref = hs.FeatureExtractor(eager, ["block"])
    out, want = fx(X), ref(X)
    torch.testing.assert_close(out["block"], want["block"], rtol=0, atol=0)
    with hs.capture(cm, ["relu", "head"], stop=True) as cap:
        cm(X)
    assert len(cap.calls("relu")) == 2 and len(cap.calls("head")) == 1
    # stopped after block.fc: the layers after it (block.act, the second relu, head) never run
    returned = []
    with (
        hs.capture(cm, ["block.act", "head"]) as later,
        hs.capture(cm, ["inp", "block.fc"], stop=True) as cap,
    ):
        returned.append(cm(X))
    assert returned == []  # the call ended by the stop signal, swallowed by its scope
    assert later.calls("block.act") == [] and later.calls("head") == []
    with hs.capture(eager, ["inp", "block.fc"]) as ref:
        eager(X)
    for k in ("inp", "block.fc"):
        assert len(cap.calls(k)) == 1
        torch.testing.assert_close(cap[k], ref[k], rtol=0, atol=0)


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_edit_and_edit_grads_equal_eager(form):
    cm, eager, _ = compiled(form)
    x = X.clone().requires_grad_()
    edits = {"block.fc": ops.scale(0.5), "relu": ops.clamp(max=0.3)}
    with hs.edit(eager, edits):
        want = eager(x)
    with hs.edit(cm, edits):
        got = cm(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(cm(x), want)  # edit gone: the original compiled graph again
    with hs.edit_grads(eager, {"block": ops.scale(3.0)}):
        (gw,) = torch.autograd.grad(eager(x).sum(), x)
    with hs.edit_grads(cm, {"block": ops.scale(3.0)}):
        (gc,) = torch.autograd.grad(cm(x).sum(), x)
    torch.testing.assert_close(gc, gw, rtol=0, atol=0)


def test_observe_and_trace_equal_eager():
    cm, eager, _ = compiled("in_place")
    got, want = [], []
    with hs.observe(cm, ["relu", "head"], lambda c: got.append((c.layer, c.output.sum()))):
        cm(X)
    with hs.observe(eager, ["relu", "head"], lambda c: want.append((c.layer, c.output.sum()))):
        eager(X)
    assert [g[0] for g in got] == [w[0] for w in want] == ["relu", "relu", "head"]
    for (_, a), (_, b) in zip(got, want):
        assert torch.equal(a, b)
    with hs.trace(cm, quiet=True) as tc:
        cm(X)
    with hs.trace(eager, quiet=True) as te:
        eager(X)
    assert [(e.layer, e.index, e.type, e.input_shapes, e.output_shapes) for e in tc.events] == [
        (e.layer, e.index, e.type, e.input_shapes, e.output_shapes) for e in te.events
    ]
    assert tc.events[0].layer == ""  # the root first, named as in the eager model


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_monitor_records_equal_eager(form):
    cm, eager, _ = compiled(form)
    recs = {}
    for key, model in (("compiled", cm), ("eager", eager)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hs.Monitor(model, every=2, alerts="off") as mon:
            for _ in range(4):
                opt.zero_grad()
                model(X).pow(2).mean().backward()
                opt.step()
                mon.step()
        recs[key] = list(mon.records)
    assert_records_equal(recs["compiled"], recs["eager"], steps=[0, 2])


PARAMS = ["inp.weight", "inp.bias", "block.fc.weight", "block.fc.bias", "head.weight", "head.bias"]


def assert_records_equal(got: list, want: list, steps: list[int]) -> None:
    """Monitor records of the compiled model equal the eager model's: as many, the same steps,
    the same layers, parameters and statistics (every parameter has some), the same values."""
    assert [r.step for r in got] == [r.step for r in want] == steps
    for a, b in zip(got, want, strict=True):
        assert list(a.layers) == list(b.layers) and a.layers
        assert sorted(a.params) == sorted(b.params) == sorted(PARAMS)
        for group, ref in (("layers", b.layers), ("params", b.params)):
            for name, stats in getattr(a, group).items():
                assert stats and stats.keys() == ref[name].keys(), (group, name)
                for stat, v in stats.items():
                    assert v == pytest.approx(ref[name][stat], rel=1e-5, abs=1e-7), (name, stat)


def test_find_nonfinite_names_the_layer():
    cm, eager, _ = compiled("wrapper")
    with torch.no_grad():
        cm.block.fc.weight[0, 0] = float("inf")
        eager.block.fc.weight[0, 0] = float("inf")
    got, want = hs.find_nonfinite(cm, X), hs.find_nonfinite(eager, X)
    assert got is not None and want is not None
    assert (got.layer, got.phase, got.kind) == (want.layer, want.phase, want.kind)
    assert got.layer == "block.fc" and got.stats.keys() == want.stats.keys()


def test_summary_rows_equal_eager():
    cm, eager, _ = compiled("wrapper")
    a, b = hs.summary(cm, X), hs.summary(eager, X)
    key = lambda r: (r.name, r.type, r.output_shapes, r.params)  # noqa: E731
    assert [key(r) for r in a.rows] == [key(r) for r in b.rows]
    assert not any("_orig_mod" in r.name for r in a.rows)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.features(x)).flatten(1))


def test_gradcam_equals_eager():
    net = ConvNet()
    eager = copy.deepcopy(net)
    cm = torch.compile(net, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8)
    cm(x)
    got = hs.GradCAM(cm, "features.0")(x, target=1)
    want = hs.GradCAM(eager, "features.0")(x, target=1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fullgraph_region_runs_eagerly_and_warns_naming_the_layer():
    cm, eager, _ = compiled("wrapper", fullgraph=True)
    cm(X)
    with (
        pytest.warns(hs.HookscopeWarning, match=r"'block'.*fullgraph=True"),
        hs.capture(cm, ["block"]) as cap,
    ):
        cm(X)
    with hs.capture(eager, ["block"]) as ref:
        eager(X)
    torch.testing.assert_close(cap["block"], ref["block"], rtol=0, atol=0)


class Skipper(nn.Module):
    """Calls its child's forward directly: hooks cannot fire, compiled or not (docs/pitfalls.md §8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.forward(x)


def test_hooks_that_never_ran_in_a_compiled_call_warn_naming_the_layer():
    cm = torch.compile(Skipper(), backend="eager")
    cm(X)
    with (
        pytest.warns(
            hs.HookscopeWarning, match=r"'lin'.*did not|none of the hooks on layers 'lin'"
        ),
        hs.observe(cm, ["lin"], lambda c: None),
    ):
        cm(X)


def test_scope_on_the_wrapped_module_names_the_fix():
    net = make()
    cm = torch.compile(net, backend="eager")
    cm(X)
    with pytest.raises(hs.LayerNotRunError, match="give hookscope the compiled model"):
        with hs.capture(net, ["block"]) as cap:
            cm(X)  # the user calls the wrapper hookscope was not given
        cap["block"]


def test_inductor_capture_grads_and_edit_equal_eager():
    net = ConvNet()
    eager = copy.deepcopy(net)
    cm = torch.compile(net)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    cm(x)
    with hs.capture(eager, ["features.1", "pool"], grads=True) as ref:
        eager(x).sum().backward()
    with hs.capture(cm, ["features.1", "pool"], grads=True) as cap:
        cm(x).sum().backward()
    for name in ["features.1", "pool"]:
        torch.testing.assert_close(cap[name], ref[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cap.grads[name], ref.grads[name], rtol=1e-5, atol=1e-6)
    with hs.edit(cm, {"pool": ops.zero()}):
        out = cm(x)
    torch.testing.assert_close(out, eager.fc.bias.expand(2, 5), rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm(x)


def _strip_times(text: str) -> list[str]:
    # trace's columns: layer, #, type, ms, dtype, device, shapes; drop the time
    return [" ".join(t for i, t in enumerate(line.split()) if i != 3) for line in text.splitlines()]


def test_cli_trace_and_summary_with_compile_equal_eager(capsys):
    import json

    from hookscope.cli._main import main

    assert main(["trace", "demo", "--compile", "eager"]) == 0
    compiled_out = capsys.readouterr().out
    assert main(["trace", "demo"]) == 0
    eager_out = capsys.readouterr().out
    assert _strip_times(compiled_out) == _strip_times(eager_out)
    assert "_orig_mod" not in compiled_out and "stage3.5" in compiled_out
    assert main(["summary", "demo", "--compile", "eager", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["summary", "demo", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    drop = lambda rows: [{k: v for k, v in r.items() if k not in ("time_ms", "ms")} for r in rows]  # noqa: E731
    assert drop(a["rows"]) == drop(b["rows"]) and a["rows"]


def test_cli_unknown_compile_backend_is_one_line(capsys):
    from hookscope.cli._main import main

    assert main(["summary", "demo", "--compile", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--compile nosuch" in err and "Traceback" not in err


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_parameter_grad_edits_equal_eager(form):
    cm, eager, _ = compiled(form)
    cm(X)
    grads = {}
    for key, model in (("compiled", cm), ("eager", eager)):
        model.zero_grad()
        with hs.edit_grads(
            model, {"head.weight": ops.scale(-2.0), "block.fc": ops.clamp(-0.01, 0.01)}
        ):
            model(X).pow(2).sum().backward()
        grads[key] = {n: p.grad.clone() for n, p in hs.core._compiled.named_parameters(model)}
    assert list(grads["compiled"]) == list(grads["eager"])
    for n in grads["eager"]:
        torch.testing.assert_close(grads["compiled"][n], grads["eager"][n], rtol=0, atol=0)


def test_remove_hooks_on_a_compiled_model_restores_the_original_graph():
    counter = CompileCounterWithBackend("eager")
    net = make()
    cm = torch.compile(net, backend=counter)
    cm(X)
    scope = hs.capture(cm, ["block", "head"])
    cm(X)
    assert cm.__dict__["forward"].__name__ == "routed"  # calls go through the hooked variant
    assert hs.remove_hooks(cm) == 2
    assert cm.__dict__["forward"].__name__ != "routed"
    frames = counter.frame_count
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "hooks did not run" warning: nothing is routed
        cm(X)
    assert counter.frame_count == frames
    scope.remove()


def test_a_compiled_part_inside_a_compiled_model():
    net = make()
    eager = copy.deepcopy(net)
    net.block = torch.compile(net.block, backend="aot_eager")
    cm = torch.compile(net, backend="aot_eager")
    cm(X)
    assert list(hs.find(cm)) == [n for n, _ in eager.named_modules()]
    for _ in range(2):
        with hs.capture(cm, ["block.fc", "head"]) as cap:
            cm(X)
        with hs.capture(eager, ["block.fc", "head"]) as ref:
            eager(X)
        for k in ["block.fc", "head"]:
            torch.testing.assert_close(cap[k], ref[k], rtol=0, atol=0)


def test_extract_from_a_compiled_model_equals_eager(tmp_path):
    import numpy as np

    cm, eager, _ = compiled("wrapper")
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.zeros(10))
    a = hs.extract(cm, data, ["block"], tmp_path / "c", batch_size=4, progress=False)
    b = hs.extract(eager, data, ["block"], tmp_path / "e", batch_size=4, progress=False)
    assert list(a) == list(b) == ["block"]
    np.testing.assert_array_equal(np.asarray(a["block"]), np.asarray(b["block"]))


def test_a_sequential_stays_compiled_between_hooked_layers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    eager = copy.deepcopy(net)
    counter = CompileCounterWithBackend("aot_eager")
    cm = torch.compile(net, backend=counter)
    cm(X)
    bare = counter.frame_count
    frames = []
    for _ in range(3):
        with hs.capture(cm, ["1", "3"]) as cap:
            cm(X)
        with hs.capture(eager, ["1", "3"]) as ref:
            eager(X)
        for k in ["1", "3"]:
            torch.testing.assert_close(cap[k], ref[k], rtol=0, atol=0)
        frames.append(counter.frame_count - bare)
    # the layers between the hooks ran as compiled graphs (not the whole loop eagerly), compiled
    # by the first scope only
    assert frames[0] >= 2 and frames == [frames[0]] * 3


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_monitor_with_accumulation_on_a_compiled_model_equals_eager(form):
    """Two micro-batches per optimizer step: the compiled model's calls start micro-batches as
    the eager model's do (the root pre-hook runs around the compiled forward)."""
    cm, eager, _ = compiled(form)
    recs = {}
    for key, model in (("compiled", cm), ("eager", eager)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hs.Monitor(model, alerts="off") as mon:
            for _ in range(2):
                for xs in X.chunk(2):
                    (model(xs).pow(2).mean() / 2).backward()
                opt.step()
                mon.step(opt)
                opt.zero_grad()
        recs[key] = list(mon.records)
    assert_records_equal(recs["compiled"], recs["eager"], steps=[0, 1])
    for r in recs["compiled"]:
        assert list(r.layers) == ["inp", "relu", "block.fc", "block.act", "relu#1", "head"]


def test_two_threads_calling_a_compiled_model_while_a_scope_routes_it():
    """A scope opened in thread A routes the compiled model while thread B calls it plainly: A's
    scope sees A's call only, B gets the plain values, and the model's forward and Dynamo's
    config are left as found (routed calls run one at a time; without the lock the second call
    saved the first one's swapped forward and put it back for good)."""
    import threading

    cm, eager, _ = compiled("wrapper", backend="eager")
    cm(X)
    config = dict(dynamo.config.get_config_copy())
    a_inside, b_done = threading.Event(), threading.Event()
    outs, caps = {}, {}

    def pause(value: torch.Tensor) -> None:  # an edit that keeps the value, waiting in thread A
        a_inside.set()
        b_done.wait(0.5)

    def run(name: str) -> None:
        if name == "A":
            with hs.capture(cm, ["block.fc"]) as cap, hs.edit(cm, {"block.fc": pause}):
                outs[name] = cm(X)
            caps[name] = cap
        else:
            a_inside.wait(30)
            outs[name] = cm(X)
            b_done.set()

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with hs.capture(eager, ["block.fc"]) as ref:
        want = eager(X)
    for name in "AB":
        torch.testing.assert_close(outs[name], want, rtol=0, atol=0)
    assert len(caps["A"].calls("block.fc")) == 1
    torch.testing.assert_close(caps["A"]["block.fc"], ref["block.fc"], rtol=0, atol=0)
    assert "forward" not in cm._orig_mod.__dict__  # no hooked variant left behind
    assert cm.__dict__["forward"].__name__ != "routed"
    assert dict(dynamo.config.get_config_copy()) == config


def test_capture_grads_of_compiled_hf_attention_equal_eager():
    """GPT-2's attention returns (output, weights); the compiled graph hands the weights' hook
    ``None`` (nothing after the layer uses them), which eager autograd never does."""
    from helpers.lm import tiny_gpt2

    model = tiny_gpt2()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    name = "transformer.h.0.attn"
    with hs.capture(model, [name], grads=True) as ref:
        model(ids, attention_mask=mask).logits.sum().backward()
    cm = torch.compile(model, backend="aot_eager")
    with hs.capture(cm, [name], grads=True) as cap:
        cm(ids, attention_mask=mask).logits.sum().backward()
    torch.testing.assert_close(cap[name][0], ref[name][0])
    torch.testing.assert_close(cap.grads[name][0], ref.grads[name][0])
    # eager counts the weights' own use inside the layer (attn @ value) in their gradient; a
    # compiled graph's output is a copy that nothing downstream uses: no gradient, said as None
    assert cap.grads[name][1] is None


@pytest.mark.parametrize("form", FORMS)
def test_deepcopy_of_a_compiled_model_with_a_scope_open(form):
    """The copy runs its own weights with inert hooks (the original's capture gets nothing from
    it); a scope on the copy records the copy's values; the original keeps being routed."""
    cm, eager, pre = compiled(form, backend="eager")
    cm(X)
    layer = pre + "block.fc"
    with hs.capture(cm, [layer]) as cap:
        twin = copy.deepcopy(cm)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2.0)
        got = twin(X)
        assert cap.calls(layer) == []
        with hs.capture(twin, [layer]) as on_copy:
            got_hooked = twin(X)
        cm(X)
    assert len(cap.calls(layer)) == 1 and len(on_copy.calls(layer)) == 1
    ref_twin = copy.deepcopy(eager)
    with torch.no_grad():
        for p in ref_twin.parameters():
            p.mul_(2.0)
    with hs.capture(ref_twin, [layer]) as ref:
        want = ref_twin(X)
    with hs.capture(eager, [layer]) as ref_orig:
        eager(X)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_hooked, want, rtol=0, atol=0)
    torch.testing.assert_close(on_copy[layer], ref[layer], rtol=0, atol=0)
    torch.testing.assert_close(cap[layer], ref_orig[layer], rtol=0, atol=0)
    assert {i.feature for i in hs.hooks_on(twin)} == {"capture (inert copy)"}
    assert hs.remove_hooks(twin) >= 1


class _Looped(nn.Module):
    """Blocks called in a loop over a ModuleList (Dynamo unrolls it into one graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_hooks_inside_a_warm_compiled_loop_equal_eager():
    """A compiled model called once before: hooks on a module inside its ModuleList loop run
    (the hooked variant never falls back to the code that earlier call compiled without them),
    with no warning, and the values equal eager; so they do after torch._dynamo.reset()."""
    eager = _Looped()
    cm = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    x = torch.randn(5, 6)
    cm(x)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", hs.HookscopeWarning)
            with hs.capture(cm, "blocks.1.fc") as cap, hs.capture(eager, "blocks.1.fc") as ref:
                cm(x)
                eager(x)
        torch.testing.assert_close(
            cap.calls("blocks.1.fc")[0].output, ref.calls("blocks.1.fc")[0].output, rtol=0, atol=0
        )
        dynamo.reset()
