"""hs.compare on live models: errors against hand-computed references, verdicts, matching, the
model left as found, cost of the replay."""

from __future__ import annotations

import copy
import gc
import importlib
import json
import math
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.faults import BadBackwardLinear, cnn


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.GELU()), nn.Linear(16, 4)
    )


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def test_an_exact_copy_differs_by_exactly_zero_everywhere():
    a = _mlp()
    r = hs.compare(a, copy.deepcopy(a), X, loss_fn=_loss)
    assert r.culprit is None and r.first_divergent is None and r.unmatched == []
    assert [x.label for x in r.rows] == ["<root>", "0", "1", "2", "2.0", "2.1", "3"]
    for row in r.rows:
        assert row.error == 0.0 and row.local_error == 0.0, row
        assert row.grad_error in (0.0, None) and row.local_grad_error in (0.0, None), row


def test_local_error_is_the_faulty_module_run_on_a_own_inputs():
    a = _mlp()
    b = copy.deepcopy(a)
    b[2][1].approximate = "tanh"  # the GELU variant
    r = hs.compare(a, b, X, loss_fn=_loss)
    # reference by hand: a plain forward hook on A's GELU, then B's GELU on that input
    seen = {}
    h = a[2][1].register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach(), y=o.detach()))
    try:
        a(X)
    finally:
        h.remove()
    want = float((F.gelu(seen["x"], approximate="tanh") - seen["y"]).norm() / seen["y"].norm())
    row = r.row("2.1")
    assert row.local_error == pytest.approx(want, rel=1e-6) and want > 1e-5
    assert row.flagged == "forward" and r.culprit == "2.1" and r.culprits == ["2.1"]
    # modules before the fault and the glue of its ancestors add nothing of their own
    assert r.row("0").local_error == 0.0 and r.row("2").local_error == 0.0
    assert r.row("3").local_error == 0.0 and r.row("").local_error == 0.0
    # the error shows first where the fault's output is made; the ancestor ends later
    assert r.first_divergent == "2.1"
    assert r.row("3").error > 0 and r.row("2").error > 0


def test_a_backward_only_fault_is_named_by_its_local_gradient_error():
    a = _mlp()
    b = copy.deepcopy(a)
    b[2][0].__class__ = BadBackwardLinear  # forward exact, output gradient scaled by 1.5
    r = hs.compare(a, b, X, loss_fn=_loss)
    row = r.row("2.0")
    assert row.local_error == 0.0 and row.error == 0.0
    # B's vector-Jacobian product at A's inputs with A's output gradient: 1.5 times A's
    assert row.local_grad_error == pytest.approx(0.5, rel=1e-6)
    assert row.flagged == "backward" and r.culprit == "2.0"
    # without a loss there is no backward to compare: no verdict
    assert hs.compare(a, b, X).culprit is None


def test_parameter_gradients_of_the_whole_runs_against_autograd():
    a = _mlp()
    b = copy.deepcopy(a)
    b[2][0].__class__ = BadBackwardLinear
    r = hs.compare(a, b, X, loss_fn=_loss)
    ga = torch.autograd.grad(_loss(a(X)), [a[0].weight, a[0].bias])
    gb = torch.autograd.grad(_loss(b(X)), [b[0].weight, b[0].bias])
    num = sum(float((y - x).norm()) ** 2 for x, y in zip(ga, gb)) ** 0.5
    den = sum(float(x.norm()) ** 2 for x in ga) ** 0.5
    assert r.row("0").param_grad_error == pytest.approx(num / den, rel=1e-6)
    assert r.row("0").local_grad_error == 0.0  # the first layer's own backward is right


@pytest.mark.parametrize("variant", ["bf16", "autocast"])
def test_fault_free_bf16_pairs_name_no_culprit_and_say_why_pooling_gradients_differ(variant):
    a, inputs, kwargs, loss = cnn()
    b = copy.deepcopy(a)
    ac = None
    if variant == "bf16":
        b = b.to(torch.bfloat16)
    else:
        ac = torch.bfloat16
    r = hs.compare(a, b, *inputs, loss_fn=loss, autocast=ac, **kwargs)
    assert r.culprit is None and r.dtypes == ("float32", "bfloat16")
    for row in r.rows:
        assert row.local_error < row.tol, row
    pool = r.row("pool")
    # max pooling's argmax ties in bf16: its gradient moves by nature; said, not flagged
    assert pool.local_grad_error > pool.tol and pool.flagged is None
    assert "not stable across dtypes" in pool.note


def test_module_calls_are_matched_by_name_and_occurrence_and_extra_calls_listed():
    class Twice(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.n = n
            self.lin = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.n):
                x = self.act(self.lin(x))
            return x

    torch.manual_seed(0)
    a = Twice(2)
    b = copy.deepcopy(a)
    b.n = 3
    r = hs.compare(a, b, torch.randn(3, 4))
    assert sorted(r.unmatched) == ["b: act#2", "b: lin#2"]
    assert [x.label for x in r.rows] == ["<root>", "lin", "act", "lin#1", "act#1"]
    assert r.row("lin", 1).local_error == 0.0  # the second call paired with the second call
    assert r.culprit == "" and r.row("").flagged == "forward"  # the root's loop is what changed


def test_renamed_port_by_dict_or_function_and_modules_without_counterpart_listed():
    class Port(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.nonlin = nn.Tanh()
            self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.out = nn.Linear(16, 4)
            self.extra = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.block(self.nonlin(self.inp(self.extra(x)))))

    a = _mlp()
    b = Port()
    b.inp.load_state_dict(a[0].state_dict())
    b.block.load_state_dict(a[2].state_dict())
    b.out.load_state_dict(a[3].state_dict())
    table = {
        "0": "inp",
        "1": "nonlin",
        "2": "block",
        "2.0": "block.0",
        "2.1": "block.1",
        "3": "out",
    }
    for names in (table, lambda n: table.get(n, n)):
        r = hs.compare(a, b, X, loss_fn=_loss, names=names)
        assert r.culprit is None and r.unmatched == ["b: extra#0"]
        assert r.row("2.0").b_name == "block.0" and r.row("2.0").local_error == 0.0
    # a function returning None: no counterpart (here the root), listed on both sides
    r = hs.compare(a, b, X, names=table.get)
    assert r.unmatched == ["a: <root>#0", "b: <root>#0", "b: extra#0"]
    b.block[1].approximate = "tanh"
    r = hs.compare(a, b, X, loss_fn=_loss, names=table)
    assert r.culprit == "2.1"


def test_a_model_that_draws_random_numbers_is_refused_by_name():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    with pytest.raises(hs.CompareError, match=r"draws random numbers.*\.eval\(\)"):
        hs.compare(a, copy.deepcopy(a), torch.randn(2, 4))


class _Noisy(nn.Module):
    """Dropout called as a function, on whatever the mode: draws in eval mode too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.5, training=True)


def test_a_draw_in_eval_mode_is_refused_naming_its_module_and_a_draw_in_the_loss_as_the_loss_s():
    """A model in eval mode whose code draws whatever the mode is refused naming the module that
    draws (not "call .eval()", which would not help); a loss_fn that draws is refused as the
    loss's, not the model's; neither leaves the model changed."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), _Noisy())).eval()
    x = torch.randn(2, 4)
    with pytest.raises(hs.CompareError, match=r"in the forward of '1\.1' \(_Noisy\).*no module is"):
        hs.compare(a, copy.deepcopy(a), x)
    assert all(p.grad is None for p in a.parameters())
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(hs.CompareError, match=r"^hs.compare: loss_fn draws random numbers"):
        hs.compare(
            plain, copy.deepcopy(plain), x, loss_fn=lambda o: (o * torch.randn_like(o)).sum()
        )
    # a loss that draws from a generator of its own, seeded inside it, is deterministic: fine
    seeded = lambda o: (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(0))).sum()  # noqa: E731
    assert hs.compare(plain, copy.deepcopy(plain), x, loss_fn=seeded).culprit is None


def test_both_models_are_left_as_found():
    a, inputs, kwargs, loss = cnn()  # BatchNorm in training mode: running stats would move
    b = copy.deepcopy(a).to(torch.bfloat16)
    a.fc.weight.grad = torch.ones_like(a.fc.weight)
    before_a = {k: v.clone() for k, v in a.state_dict().items()}
    before_b = {k: v.clone() for k, v in b.state_dict().items()}
    hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
    for k, v in a.state_dict().items():
        assert torch.equal(v, before_a[k]), k
    for k, v in b.state_dict().items():
        assert torch.equal(v, before_b[k]), k
    assert torch.equal(a.fc.weight.grad, torch.ones_like(a.fc.weight))
    assert b.fc.weight.grad is None and a.training and b.training
    assert "forward" not in a.bn1.__dict__ and not hs.hooks_on(a) and not hs.hooks_on(b)


class _Cycle:
    """An object that refers to itself (freed only by the cycle collector), holding a tensor."""

    def __init__(self) -> None:
        self.me, self.t = self, torch.zeros(1000)


_LEFT: list[weakref.ref] = []  # the cycles the runs of _LeavesCycles left, by weak reference
_SEEN: list[list[bool]] = []  # at each run's start: which of the earlier runs' are alive


class _LeavesCycles(nn.Linear):
    """A forward that leaves a reference cycle behind (as a Transformers cache can)."""

    def forward(self, x):
        if not _SEEN or len(_SEEN[-1]) != len(_LEFT):
            _SEEN.append([r() is not None for r in _LEFT])
        _LEFT.append(weakref.ref(_Cycle()))
        return super().forward(x)


def test_collection_is_as_found_after_compare_and_each_run_s_cycles_are_freed_at_its_end():
    """hs.compare pauses automatic garbage collection (its records would be promoted to the
    oldest generation, and full collections of the whole process follow), collects the young
    generation at each run's end and resumes collection on exit, an error's too; collection that
    the caller disabled stays disabled."""
    torch.manual_seed(0)
    a = nn.Sequential(_LeavesCycles(4, 4), nn.Tanh())
    x = torch.randn(2, 4)
    _LEFT.clear()
    _SEEN.clear()
    assert gc.isenabled()
    hs.compare(a, copy.deepcopy(a), x, loss_fn=lambda o: o.sum())
    assert gc.isenabled()
    # each run (A's, B's, B's replay) found the cycles of the runs before it freed
    assert len(_SEEN) >= 3 and all(not any(alive) for alive in _SEEN)
    drops = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    with pytest.raises(hs.CompareError):
        hs.compare(drops, copy.deepcopy(drops), x)
    assert gc.isenabled()
    gc.disable()
    try:
        hs.compare(a, copy.deepcopy(a), x)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _ClipsItself(nn.Linear):
    """Weight clipping inside the forward: the module changes its own weight in place."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1).mul_(1.5)
        return super().forward(x)


def test_a_model_that_changes_its_own_weights_in_its_forward_is_refused_by_name():
    """Each run and replay starts from the weights the last one left: an exact copy had its
    clipping layer named as the culprit. Refused naming the parameter."""
    torch.manual_seed(0)
    a = nn.Sequential(_ClipsItself(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(
        hs.CompareError, match=r"model 'a' .*changes its own parameters.*'0\.weight'"
    ):
        hs.compare(a, copy.deepcopy(a), torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not hs.hooks_on(a)


def test_each_module_runs_once_in_the_replay_whatever_the_depth():
    calls = {"n": 0}

    class Counted(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return super().forward(x)

    torch.manual_seed(0)
    leaf = Counted(4, 4)
    deep: nn.Module = leaf
    for _ in range(8):  # eight levels of nesting around one leaf
        deep = nn.Sequential(deep, nn.Identity())
    b = copy.deepcopy(deep)
    b_leaf = b.get_submodule(".".join(["0"] * 8))
    b_leaf.weight.data.mul_(1.01)
    calls["n"] = 0
    r = hs.compare(deep, b, torch.randn(2, 4), loss_fn=lambda o: o.sum())
    # A: one run; B: one run + one replay (A's module, called once, needs no replay: its local
    # parameter gradients are the run's .grad)
    assert calls["n"] == 3
    assert r.culprit == ".".join(["0"] * 8)


def test_report_renders_as_table_dict_and_plot():
    a = _mlp()
    b = copy.deepcopy(a)
    b[3].weight.data.mul_(1.1)
    r = hs.compare(a, b, X, loss_fn=_loss)
    text = str(r)
    assert "culprit '3'" in text and "local grad" in text
    d = json.loads(json.dumps(r.to_dict()))
    assert d["culprit"] == "3" and len(d["rows"]) == len(r.rows)
    assert d["rows"][-1]["flagged"] == "forward"
    fig = r.plot()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [x.label for x in r.rows]
    assert "3" in ax.get_title()
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(r)
    assert "culprit '3'" in console.export_text()


def test_a_module_called_twice_gets_its_parameter_gradients_per_call():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    a = nn.Sequential(lin, nn.Tanh(), lin)  # one module, two calls: a shared weight
    b = copy.deepcopy(a)
    b[0].__class__ = BadBackwardLinear  # the copy keeps the sharing: both calls are off
    r = hs.compare(a, b, torch.randn(3, 4), loss_fn=lambda o: o.pow(2).sum())
    assert [x.label for x in r.rows] == ["<root>", "0", "1", "0#1"]
    assert r.row("0", 0).local_grad_error == pytest.approx(0.5, rel=1e-6)
    assert r.row("0", 1).local_grad_error == pytest.approx(0.5, rel=1e-6)
    assert r.culprit == "0" and r.culprits == ["0", "0#1"]


class _TwoValueNorm(nn.Module):
    """A block as at the end of a ResNet on small images: batch norm in training mode over two
    values per channel (batch 2, 1x1), then a residual add and ReLU. Its gradient is zero up to
    the norm's eps: in bf16 it is all rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x)) + x  # not in place: its gradient is recorded
        out = self.relu(out)
        return self.head(out.flatten(1))


def test_an_ill_conditioned_module_in_bf16_is_not_a_culprit_but_a_fault_still_is():
    """The bf16 copy's norm is off by tens of percent in backward: so is A's own module computing
    in bf16 on A's values, so the row is noted, not flagged; a real fault after it is named."""
    torch.manual_seed(0)
    a = _TwoValueNorm().train()
    x = torch.randn(2, 8, 1, 1)
    loss = lambda o: o.logsumexp(-1).mean()  # noqa: E731
    r = hs.compare(a, copy.deepcopy(a).to(torch.bfloat16), x, loss_fn=loss)
    assert r.culprit is None
    bn = r.row("bn")
    assert bn.local_grad_error > 10 * bn.tol  # the gradient really is that far off
    assert "ill-conditioned in bfloat16" in bn.note or "not stable across dtypes" in bn.note
    b = copy.deepcopy(a)
    b.head.weight.data.mul_(1.2)
    assert hs.compare(a, b.to(torch.bfloat16), x, loss_fn=loss).culprit == "head"


def test_the_copies_in_the_lower_dtype_are_made_per_subtree_and_stay_one_tree():
    """The conditioning checks replay A's modules in B's dtype: each module is copied (with its
    own subtree) when a replay first asks for it, not the whole model; a module inside a copied
    subtree is that copy's child, and a later copy of its ancestor replaces a standalone copy of
    it, so a replay of the ancestor stubs the very child object it calls."""
    replay = importlib.import_module("hookscope.compare._replay")
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    source = {n: m for n, m in a.named_modules()}
    copies = replay.CopiesIn(source, torch.bfloat16)
    norm = copies.get("1.1")
    assert set(copies) == {"1.1"} and norm is not source["1.1"]
    assert norm.weight.dtype == torch.bfloat16 and source["1.1"].weight.dtype == torch.float32
    torch.testing.assert_close(norm.weight, source["1.1"].weight.to(torch.bfloat16), rtol=0, atol=0)
    block = copies.get("1")
    assert set(copies) == {"1", "1.0", "1.1"}
    assert copies.get("1.1") is block[1] and copies.get("1.0") is block[0]  # one tree
    assert copies.get("nothing") is None and copies.get("nothing", 3) == 3
    assert copies.get("") is not a and set(copies) == set(source)  # the root: every module
    x = torch.randn(2, 4)
    torch.testing.assert_close(
        copies.get("")(x.to(torch.bfloat16)),
        copy.deepcopy(a).to(torch.bfloat16)(x.to(torch.bfloat16)),
        rtol=0,
        atol=0,
    )


def test_the_cast_of_one_tensor_takes_the_dtypes_as_the_walk_does():
    """``_cast``'s one-tensor paths give what the general walk gives: the dtype kept for the
    leaf where exactly one is kept, else the replay's dtype (a list of another length, none)."""
    replay = importlib.import_module("hookscope.compare._replay")
    cpu = torch.device("cpu")
    t = torch.randn(3)
    for like, want in [
        ([torch.float16], torch.float16),
        (torch.zeros(1, dtype=torch.float16), torch.float16),
        (None, torch.float64),
        ([], torch.float64),
        ([torch.float16, torch.bfloat16], torch.float64),
    ]:
        got = replay._cast(t, like, torch.float64, cpu)
        walked = replay._cast(
            [t], [like] if like.__class__ is torch.Tensor else like, torch.float64, cpu
        )
        assert got.dtype == want and walked[0].dtype == want
        torch.testing.assert_close(got, t.to(want), rtol=0, atol=0)
        assert got.data_ptr() != t.data_ptr()  # never the recorded tensor itself
    (x,), kw = replay._cast(((t,), {}), [torch.bfloat16], torch.float64, cpu)
    assert kw == {} and x.dtype == torch.bfloat16
    torch.testing.assert_close(x, t.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("a_recorded", [False, True], ids=["live", "record"])
@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_hook_of_the_model_s_own_is_part_of_its_module_s_call(tmp_path, kind, a_recorded):
    """A call is what ``module(x)`` does, the module's own hooks included: a forward pre-hook
    (or forward hook) of B's scaling what its Linear gets (or gives) by 1.1 makes that Linear
    the culprit with the local error a hand-written check gives, not its caller (whose code hands
    it the same tensor as A's); the same hook on both models names nothing."""
    a = _mlp()
    b = copy.deepcopy(a)
    lin = b[2][0]

    def scale_in(m, args):
        return (args[0] * 1.1,)

    def scale_out(m, args, out):
        return out * 1.1

    def hook(m):
        if kind == "pre":
            return m.register_forward_pre_hook(scale_in)
        return m.register_forward_hook(scale_out)

    hook(lin)
    src = a
    if a_recorded:
        with hs.record(a, tmp_path / "rec"):
            _loss(a(X)).backward()
        a.zero_grad(set_to_none=True)
        src = tmp_path / "rec"
    report = hs.compare(src, b, X, loss_fn=_loss)
    assert report.culprit == "2.0" and report.culprits == ["2.0"]
    with torch.no_grad():  # A's own input to the Linear, and the Linear as a hand-written check
        h = a[1](a[0](X))
        want = lin(h)  # with its hook
        ref = a[2][0](h)
    row = report.row("2.0")
    assert row.local_error == pytest.approx(((want - ref).norm() / ref.norm()).item(), rel=1e-5)
    assert report.row("2").local_error == 0.0 and report.row("").local_error == 0.0
    if not a_recorded:
        hook(a[2][0])
        assert hs.compare(a, b, X, loss_fn=_loss).culprit is None


class _Router(nn.Module):
    """A top-2 router as transformers' MoE routers: logits, the chosen experts' weights, their
    indices (an integer output that rounding in bf16 flips where two experts nearly tie)."""

    def __init__(self, d: int = 16, e: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, d) / d**0.5)

    def forward(self, x):
        logits = x @ self.weight.T
        w, idx = logits.softmax(-1).topk(2, -1)
        return logits, w / w.sum(-1, keepdim=True), idx


class _MoE(nn.Module):
    def __init__(self, d: int = 16, e: int = 6) -> None:
        super().__init__()
        self.router = _Router(d, e)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x):
        _, w, idx = self.router(x)
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            out = out + (w * (idx == j)).sum(-1, keepdim=True) * ex(x)
        return out


def test_a_router_fault_is_named_in_bf16_though_rounding_flips_its_expert_choices():
    """Rounding in bf16 flips some expert indices, in B as in A's own module computing in bf16:
    the integer output's error is inf on both sides. The router's floating outputs still show a
    fault (its weight x1.2: the logits off by 0.2), which was hidden (inf against inf read as
    ill-conditioned); a fault-free bf16 copy still names nothing."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 16), _MoE(), nn.Linear(16, 4))
    with torch.no_grad():  # nearly tied experts: bf16 flips the choice on some tokens
        g = a[1].router.weight
        g[1] = g[0] + 1e-3 * torch.randn(16)
        g[3] = g[2] + 1e-3 * torch.randn(16)
    x = torch.randn(2, 24, 16)
    loss = lambda o: o.float().logsumexp(-1).mean()  # noqa: E731
    free = hs.compare(a, copy.deepcopy(a).to(torch.bfloat16), x, loss_fn=loss)
    assert free.culprit is None
    assert free.row("1.router").local_error == math.inf  # the indices flipped: the case at hand
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[1].router.weight.mul_(1.2)
    report = hs.compare(a, b.to(torch.bfloat16), x, loss_fn=loss)
    assert report.culprit == "1.router" and report.row("1.router").flagged == "forward"


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class _Binned(nn.Module):
    """A value and its bin: an integer output that rounding in bf16 moves across bin edges."""

    def __init__(self, broken_backward: bool = False) -> None:
        super().__init__()
        self.broken_backward = broken_backward

    def forward(self, x):
        y = _DoubleGrad.apply(x) if self.broken_backward else x
        return torch.tanh(y), (x * 7).round().long()


def test_a_backward_fault_is_named_where_the_forward_s_error_is_explained():
    """The forward's error is explained (bins flipped by bf16 rounding, in A's own module in
    bf16 too), so the verdict also looks at the backward: a backward-only fault there is named
    (it was never looked at once the forward was explained)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self, broken: bool) -> None:
            super().__init__()
            self.lin, self.bin, self.out = nn.Linear(8, 8), _Binned(broken), nn.Linear(8, 2)

        def forward(self, x):
            h, k = self.bin(self.lin(x))
            return self.out(h) + k.float().mean()

    a = Net(False)
    x = torch.randn(16, 8)
    loss = lambda o: o.float().pow(2).sum()  # noqa: E731
    free = hs.compare(a, copy.deepcopy(a).to(torch.bfloat16), x, loss_fn=loss)
    assert free.culprit is None and free.row("bin").local_error == math.inf
    b = copy.deepcopy(a)
    b.bin.broken_backward = True
    report = hs.compare(a, b.to(torch.bfloat16), x, loss_fn=loss)
    assert report.culprit == "bin" and report.row("bin").flagged == "backward"
    assert (
        "not stable across dtypes" in report.row("bin").note
        or "ill-conditioned" in report.row("bin").note
    )  # the forward's explanation is kept


class _SortedRouter(_Router):
    """A fault only in the indices: the chosen experts returned sorted, the weights not."""

    def forward(self, x):
        logits, w, idx = super().forward(x)
        return logits, w, idx.sort(-1).values


@pytest.mark.parametrize("first", [False, True], ids=["after-a-linear", "on-the-input"])
def test_routers_in_bf16_pairs_name_no_false_culprit_and_a_fault_in_the_indices(tmp_path, first):
    """A router reading the model's input (no gradient there) in a fault-free bf16 copy (or
    under bf16 autocast, or against an fp32 record) was named for its backward once its
    forward's flipped indices were explained (no reference for its children's gradients: not
    judged now); a fault only in its indices (sorted) is named: B's indices must equal those of
    A's own router computing in bf16 on the same values."""
    torch.manual_seed(1)
    a = (
        nn.Sequential(_MoE(), nn.Linear(16, 4))
        if first
        else nn.Sequential(nn.Linear(16, 16), _MoE(), nn.Linear(16, 4))
    )
    moe = a[0] if first else a[1]
    with torch.no_grad():  # nearly tied experts: bf16 flips the choice on some tokens
        g = moe.router.weight
        g[1] = g[0] + 1e-3 * torch.randn(16)
    x = torch.randn(4, 32, 16)
    loss = lambda o: o.float().logsumexp(-1).mean()  # noqa: E731
    with hs.record(a, tmp_path / "a"):
        loss(a(x)).backward()
    a.zero_grad(set_to_none=True)
    low = copy.deepcopy(a).to(torch.bfloat16)
    router = "0.router" if first else "1.router"
    assert hs.compare(a, low, x, loss_fn=loss).row(router).local_error == math.inf  # flipped
    for src, b, kw in [
        (a, low, {}),
        (a, copy.deepcopy(a), {"autocast": torch.bfloat16}),
        (tmp_path / "a", low, {}),
    ]:
        assert hs.compare(src, b, x, loss_fn=loss, **kw).culprit is None
    bad = copy.deepcopy(a)
    (bad[0] if first else bad[1]).router.__class__ = _SortedRouter
    assert hs.compare(a, bad, x, loss_fn=loss).culprit == router  # fp32
    assert hs.compare(a, bad.to(torch.bfloat16), x, loss_fn=loss).culprit == router


class _ThreeRouter(_Router):
    """Three experts per token where A's router chooses two: outputs of another shape."""

    def forward(self, x):
        logits = x @ self.weight.T
        w, idx = logits.softmax(-1).topk(3, -1)
        return logits, w / w.sum(-1, keepdim=True), idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_module_whose_outputs_change_shape_is_named_though_its_backward_cannot_replay(dtype):
    """B's router returns three experts per token, A's two: its backward cannot run on A's
    output gradients (another shape), which left the row without a local error and named
    nothing; its forward is replayed alone and names it, with the warning."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 16), _MoE(), nn.Linear(16, 4))
    b = copy.deepcopy(a)
    b[1].router.__class__ = _ThreeRouter
    x = torch.randn(2, 8, 16)
    loss = lambda o: o.float().logsumexp(-1).mean()  # noqa: E731
    with pytest.warns(hs.HookscopeWarning, match="could not replay 1 module call"):
        report = hs.compare(a, b.to(dtype), x, loss_fn=loss)
    row = report.row("1.router")
    assert report.culprit == "1.router" and row.local_error == math.inf
    assert "its forward replayed alone" in row.note


def test_a_module_changing_its_python_state_in_forward_is_replayed_from_where_the_run_started():
    """A call counter that scales a layer's output (a plain attribute, not a buffer): B's replay
    on A's inputs used to start from the state B's own run left (the counter one higher) and
    named the layer with a local error of 1.0 on an exact copy; each run now starts from the
    state the first one did, both models are left as found, and a real fault is still named."""
    from helpers.common import Counting

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 3), Counting(3), nn.Linear(3, 2))
    x = torch.randn(4, 3)
    loss = lambda o: o.pow(2).mean()  # noqa: E731
    b = copy.deepcopy(a)
    r = hs.compare(a, b, x, loss_fn=loss)
    assert r.culprit is None and r.first_divergent is None
    assert [(row.name, row.error, row.local_error) for row in r.rows] == [
        (n, 0.0, 0.0) for n in ("", "0", "1", "1.lin", "2")
    ]
    assert a[1].state() == b[1].state() == (False, 0, [], 0.0)
    with torch.no_grad():
        b[1].lin.weight[0, 0] += 0.1
    assert hs.compare(a, b, x, loss_fn=loss).culprit == "1.lin"


class _GradTimes(torch.autograd.Function):
    """The identity forward; its backward scales the gradient (a backward-only fault)."""

    @staticmethod
    def forward(ctx, w, k):  # type: ignore[override]
        ctx.k = k
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.k, None


class _PortLinear(nn.Module):
    """A port's own Linear: the same computation as nn.Linear, parameters named w and b."""

    def __init__(self, lin: nn.Linear, k: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(lin.weight.detach().clone())
        self.b = nn.Parameter(lin.bias.detach().clone())
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _GradTimes.apply(self.w, self.k), self.b)


def test_a_port_s_parameters_of_other_names_are_paired_by_position_and_said():
    """names= pairs a module whose parameters are named otherwise (w, b for weight, bias): their
    gradients counted as missing, a param_grad_error of 1.0 on a fault-free port, and a 10%
    weight-gradient fault went unnamed. Paired by position (same shapes in the same order),
    with a note; the fault is named."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    loss = lambda o: o.pow(2).mean()  # noqa: E731
    for k, culprit in ((1.0, None), (1.1, "0")):
        b = nn.Sequential(_PortLinear(a[0], k), nn.Tanh(), copy.deepcopy(a[2]))
        r = hs.compare(a, b, x, loss_fn=loss)
        assert r.culprit == culprit
        row = r.row("0")
        assert "paired by position" in row.note and "w (b) with weight (a)" in row.note
        if k == 1.0:
            assert row.param_grad_error == 0.0 and row.local_grad_error == 0.0
        else:
            assert row.flagged == "backward" and row.local_grad_error > 0.05


class _Shift(nn.Module):
    """Returns a Python int its caller rolls by (no tensor out)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> int:
        return int(x.shape[-1] // self.k)


class _Rolls(nn.Module):
    def __init__(self, k: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.shift, self.head = nn.Linear(8, 8), _Shift(k), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(torch.roll(h, self.shift(h), -1))


def test_a_module_returning_a_python_number_is_compared():
    """A module's Python int output (4 in A, 2 in B) had no errors at all and the culprit went
    unnamed; numbers are compared (ints exactly, floats relatively)."""
    x = torch.randn(3, 8)
    loss = lambda o: o.pow(2).mean()  # noqa: E731
    r = hs.compare(_Rolls(), _Rolls(), x, loss_fn=loss)
    assert r.culprit is None and r.row("shift").error == 0.0 == r.row("shift").local_error
    r = hs.compare(_Rolls(), _Rolls(k=8), x, loss_fn=loss)
    assert r.culprit == "shift" and r.row("shift").error == math.inf
    from hookscope.compare._tolerance import rel_error

    assert rel_error((torch.ones(2), 0.5), (torch.ones(2), 0.6)) == pytest.approx(0.2)


class _Logs(nn.Module):
    """A child that returns None (a logging or statistics module)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> None:
        self.seen.append(float(x.detach().abs().sum()))


def test_a_child_returning_none_is_replayed_from_the_record_without_a_false_note():
    """A child returning None ran for real in its parent's replay, with the note "children ran
    for real (inputs changed structure)" on a fault-free pair; it is replayed like any other
    child (what its parent handed it compared with the record's)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc, self.log = nn.Linear(8, 8), _Logs()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            self.log(h)
            return h

    x = torch.randn(2, 8)
    r = hs.compare(Net(), Net(), x, loss_fn=lambda o: o.pow(2).mean())
    assert r.culprit is None and r.row("").note == "" and r.row("").local_error == 0.0


class _PathAttn(nn.Module):
    """Attention whose scale is wrong on its low-precision code path only (the same class in A
    and B: a bug of the path, not a change of B's module)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        low = torch.is_autocast_enabled("cpu") or x.dtype == torch.bfloat16
        scale = 1.0 if low else (1 / 32**0.5)
        return self.o((q @ k.transpose(-1, -2) * scale).softmax(-1) @ v)


def test_a_code_path_taken_in_the_lower_dtype_is_said_to_be_a_s_own_code_in_that_dtype():
    """The explanation by A's own module computing in B's dtype covers a path the code takes in
    that dtype: the row is not flagged (A's code does the same there), and the note no longer
    calls it only ill-conditioning: it names the code path as a possible cause (a documented
    limit)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 32), _PathAttn(), nn.Linear(32, 4))
    x = torch.randn(2, 16, 32)
    r = hs.compare(a, copy.deepcopy(a), x, loss_fn=lambda o: o.float().pow(2).mean(),
                   autocast=torch.bfloat16)  # fmt: skip
    row = r.row("1")
    assert row.local_error > row.tol and row.flagged is None
    assert "a code path the module takes in bfloat16" in row.note


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_a_bf16_copy_with_a_padded_float_mask_names_an_attention_fault_and_no_false_inf():
    """Transformers' eager attention mask is float32 filled with float32's minimum: cast to
    bf16 for B's replays it overflowed to -inf, fully masked rows softmaxed to NaN, every
    attention row read local_error inf (noted as "not stable across dtypes") and a planted
    scaling fault in one attention went unnamed. Casts saturate at the dtype's range."""
    a = _tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    loss = lambda o: o.logits.float().pow(2).mean()  # noqa: E731
    clean = hs.compare(a, copy.deepcopy(a).to(torch.bfloat16), ids, attention_mask=mask,
                       loss_fn=loss)  # fmt: skip
    assert clean.culprit is None
    assert all(r.local_error is None or math.isfinite(r.local_error) for r in clean.rows)
    b = copy.deepcopy(a).to(torch.bfloat16)
    b.transformer.h[1].attn.scaling *= 40
    r = hs.compare(a, b, ids, attention_mask=mask, loss_fn=loss)
    assert r.culprit == "transformer.h.1.attn"


def test_compare_leaves_a_transformers_config_as_found():
    """A sequence classifier sets config.problem_type from the first labels it sees; compare's
    runs left it set, so the user's next call with labels of another kind failed."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    a = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 64, (2, 6))
    hs.compare(a, copy.deepcopy(a), ids, labels=torch.tensor([0, 2]), loss_fn=lambda o: o.loss)
    assert a.config.problem_type is None


class _IntRouter(nn.Module):
    """Returns its output and a Python int computed from it (the index of its largest mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        h = self.lin(x)
        return h, int(h.mean(0).argmax())


def test_a_python_int_that_bf16_rounding_flips_is_explained_like_an_integer_tensor():
    """A fault-free bf16 copy whose module's int (an argmax of floats) flips by rounding: read
    as an infinite local error and named; it goes through the integer outputs' check (the
    floating output decides, the int is checked against A's module computing in bf16)."""
    torch.manual_seed(0)
    a = nn.Sequential(_IntRouter())
    b = copy.deepcopy(a).to(torch.bfloat16)
    torch.manual_seed(27)
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert a[0](x)[1] != b[0](x.bfloat16())[1]  # the int flips here
    r = hs.compare(a, b, x, loss_fn=lambda o: o[0].float().pow(2).mean())
    assert r.culprit is None and r.row("0").flagged is None
