"""The one-pass replay (every call of B on A's values in one forward and backward) against the
per-call replay it stands for: the same rows, and the per-call replay wherever the one pass would
not be exactly it (calls made another way, checkpointing, tied weights)."""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.faults import FAULTS, MODELS, faulty

_compare = importlib.import_module("hookscope.compare._compare")

_FIELDS = ("error", "local_error", "grad_error", "param_grad_error")


def _both(monkeypatch, a, b, *inputs, **kwargs):
    """The report with the one-pass replay, what that pass did, and the report without it."""
    seen = []
    force = _compare._Job.force

    def spy(job):
        force(job)
        seen.append(job.forced)

    monkeypatch.setattr(_compare._Job, "force", spy)
    fast = hs.compare(a, b, *inputs, **kwargs)
    monkeypatch.setattr(_compare._Job, "force", lambda job: None)
    slow = hs.compare(a, b, *inputs, **kwargs)
    monkeypatch.setattr(_compare._Job, "force", force)
    return fast, seen[0], slow


def _same(x, y):
    if x is None or y is None:
        return x is None and y is None
    if math.isinf(x) or math.isinf(y):
        return x == y
    return x == pytest.approx(y, rel=1e-5, abs=1e-12)


@pytest.mark.parametrize(
    "fault_id, bf16",
    [("llama-norm-eps", False), ("llama-down-proj-backward", True), ("vit-heads", True),
     ("cnn-bn-eps", False), ("cnn-conv1-backward", True)],
)  # fmt: skip
def test_one_pass_gives_the_per_call_replays_rows(monkeypatch, fault_id, bf16):
    fault = next(f for f in FAULTS if f.id == fault_id)
    a, inputs, kwargs, loss = MODELS[fault.model]()
    b = faulty(a, fault)
    if bf16:
        b = b.to(torch.bfloat16)
    fast, forced, slow = _both(monkeypatch, a, b, *inputs, loss_fn=loss, **kwargs)
    assert forced is not None and not forced.void and not forced.dirty
    assert len(forced.results) == len(fast.rows)  # every call replayed in the one pass
    assert fast.culprit == slow.culprit == fault.culprit
    assert [r.label for r in fast.rows] == [r.label for r in slow.rows]
    for x, y in zip(fast.rows, slow.rows):
        for field in _FIELDS:
            assert _same(getattr(x, field), getattr(y, field)), (x.label, field)
        assert x.flagged == y.flagged, x.label
        # the one pass also checks the gradient a caller's own code sends back to the calls it
        # makes where their inputs need no gradient (the per-call replay skips it: None there)
        if y.local_grad_error is not None:
            assert _same(x.local_grad_error, y.local_grad_error), x.label


class _Twice(nn.Module):
    def __init__(self, again: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.again = again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).tanh()
        return self.lin(y) if self.again else y


def test_a_call_made_another_way_is_replayed_by_itself(monkeypatch):
    """B's block calls its child twice where A's called it once: the block's row (and the extra
    call) cannot be the one pass's; it replays as before and says its child ran for real."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _Twice(False), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[1].again = True
    x = torch.randn(3, 4)
    fast, forced, slow = _both(monkeypatch, a, b, x, loss_fn=lambda o: o.pow(2).sum())
    assert not forced.void
    assert 2 in forced.dirty  # A's call of the block ("1"), in start order
    assert fast.row("1").note == slow.row("1").note
    assert "children ran for real" in fast.row("1").note and "Linear" in fast.row("1").note
    assert fast.culprit == slow.culprit == "1"
    for x_, y_ in zip(fast.rows, slow.rows):
        for field in (*_FIELDS, "local_grad_error"):
            if getattr(y_, field) is not None:
                assert _same(getattr(x_, field), getattr(y_, field)), (x_.label, field)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def test_checkpointing_voids_the_one_pass(monkeypatch):
    """A module recomputed in backward runs without the pass's hooks there (its gradients would
    be another forward's): the whole pass is dropped, every call replays by itself."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _Checkpointed(), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[1].inner[2].weight.data.mul_(1.01)
    x = torch.randn(3, 4)
    fast, forced, slow = _both(monkeypatch, a, b, x, loss_fn=lambda o: o.pow(2).sum())
    assert "backward" in forced.void and "checkpointing" in forced.void
    assert fast.culprit == slow.culprit == "1.inner.2"
    for x_, y_ in zip(fast.rows, slow.rows):
        for field in (*_FIELDS, "local_grad_error"):
            assert _same(getattr(x_, field), getattr(y_, field)), (x_.label, field)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many language models

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(ids)).tanh())


def test_tied_weights_take_their_parameter_gradients_per_call(monkeypatch):
    """The one pass sums a tied weight's gradient over the modules that hold it; those modules'
    rows replay by themselves so each gets its own (a fault in the head's backward is the
    head's, not the embedding's)."""
    from helpers.faults import BadBackwardLinear

    torch.manual_seed(0)
    a = _Tied()
    b = copy.deepcopy(a)
    b.head.__class__ = BadBackwardLinear
    ids = torch.randint(0, 10, (2, 5))
    fast, forced, slow = _both(monkeypatch, a, b, ids, loss_fn=lambda o: o.pow(2).sum())
    assert not forced.void and {r.label for r in fast.rows} == {"<root>", "embed", "mix", "head"}
    assert fast.culprit == slow.culprit == "head"
    assert fast.row("embed").local_grad_error == slow.row("embed").local_grad_error
    assert not fast.row("embed").flagged


# -- audit: the one pass against the per-call replay where a caller's code does not send a
# gradient back to a call, changes what it handed in place, or where the record lacks a gradient


class _ScaledGrad(torch.autograd.Function):
    """Forward exact (a copy, so in-place layers after it work); backward scales by ``k``."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class _BadBackward(nn.Linear):
    def forward(self, x):
        return _ScaledGrad.apply(super().forward(x), 1.5)


def _rows_agree(fast, slow):
    for x_, y_ in zip(fast.rows, slow.rows):
        assert x_.label == y_.label
        for field in (*_FIELDS, "local_grad_error"):
            if getattr(y_, field) is not None:
                assert _same(getattr(x_, field), getattr(y_, field)), (x_.label, field)
        assert x_.flagged == y_.flagged, x_.label


class _Unrolled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.drop_last = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.f(x).tanh()]
        for _ in range(2):
            outs.append(self.f(outs[-1]).tanh())
        return outs[-2] if self.drop_last else outs[-1]


def test_a_call_whose_output_the_caller_drops_is_still_seeded(monkeypatch):
    """B's block drops its last call of ``f``: the one pass seeded ``f``'s output through the
    caller's code only, so that call added nothing to ``f``'s parameter gradients and ``f`` (whose
    sum is checked against A's ``.grad``) was named; the fault is the block's (its output)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _Unrolled(), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[1].drop_last = True
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not forced.void and not forced.dirty
    assert fast.culprit == slow.culprit == "1"
    assert fast.row("1.f").local_grad_error == 0.0 and not fast.row("1.f").flagged
    _rows_agree(fast, slow)


class _Detaches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.detach = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        return ((y.detach() if self.detach else y) + h).tanh()


def test_a_call_whose_output_the_caller_detaches(monkeypatch):
    """B's block detaches ``b``'s output: ``b``'s own backward is still replayed (seeded with A's
    output gradient, as the per-call replay does; the one pass gave it no local gradient error),
    and the block gets no input gradient from ``b`` (the stub's backward does not run either):
    the gradient the block sends back to ``a`` lacks ``b``'s path, the block is the culprit."""
    torch.manual_seed(0)
    a = nn.Sequential(_Detaches())
    b = copy.deepcopy(a)
    b[0].detach = True
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not forced.void and not forced.dirty
    assert fast.row("0.b").local_grad_error == slow.row("0.b").local_grad_error == 0.0
    assert fast.row("0.a").local_grad_error == slow.row("0.a").local_grad_error == 0.0
    assert fast.row("0").local_error == 0.0 and fast.row("0").flagged == "backward"
    assert fast.culprit == "0"


class _LinReluInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.lin(x))


def test_a_gradient_the_record_lacks_does_not_cut_the_pass(monkeypatch):
    """The record has no gradient for ``lin``'s output (an in-place ReLU after it: see the test
    below): the one pass seeded each call only through its caller's code, so every call before
    the block got no gradient (no local gradient error for ``0``; all of ResNet's rows)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _LinReluInPlace(), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[0].weight.data.mul_(1.01)  # a parameter change: only its gradient shows it
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not forced.void and not forced.dirty
    assert fast.row("0").local_grad_error is not None
    assert fast.culprit == slow.culprit == "0"
    _rows_agree(fast, slow)


class _Scale(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.ones(width))
        self.k = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k + self.bias


class _InPlaceResidual(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.scale, self.f = _Scale(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        h += self.f(self.scale(h).tanh())  # h changes in place after it was handed to scale
        h += self.f(self.scale(h).tanh())
        return h


def _residual_pair(k: float, width: int = 4) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(width, width), _InPlaceResidual(width), nn.Linear(width, 2))
    b = copy.deepcopy(a)
    b[1].scale.k = k
    return a, b


# 3x4: what was handed is stacked with the pairs of its size when the norms are computed; 80x64
# (more than _tolerance._GROUP values): computed by itself
@pytest.mark.parametrize("shape", [(3, 4), (80, 64)])
@pytest.mark.parametrize("k", [2.0, 2.02])
def test_a_caller_that_changes_what_it_handed_in_place(monkeypatch, k, shape):
    """The caller's ``h += f(scale(h))`` changes ``h`` after handing it to ``scale``: the error of
    what it handed was computed later on the changed ``h`` (the block flagged on a fault-free
    pair). The one pass keeps a copy of what was handed; the fault, if any, is ``scale``'s."""
    a, b = _residual_pair(k, shape[1])
    x = torch.randn(*shape)
    fast, forced, _slow = _both(monkeypatch, a, b, x, loss_fn=lambda o: o.sum())
    assert not forced.void and not forced.dirty
    assert fast.row("1").local_error == 0.0 and fast.row("1").flagged is None
    assert fast.culprit == (None if k == 2.0 else "1.scale")


@pytest.mark.parametrize("shape", [(3, 4), (80, 64)])
def test_the_per_call_replay_reads_what_the_caller_handed_as_it_was(monkeypatch, shape):
    a, b = _residual_pair(2.0, shape[1])
    monkeypatch.setattr(_compare._Job, "force", lambda job: None)
    report = hs.compare(a, b, torch.randn(*shape), loss_fn=lambda o: o.sum())
    assert report.row("1").local_error == 0.0 and report.culprit is None


# -- audit findings beyond the one pass: in-place ReLU gradients, parameters used outside their
# module's calls, calls that work in place on what their caller keeps


def test_a_backward_fault_before_an_in_place_relu_is_found():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[1].__class__ = _BadBackward
    report = hs.compare(a, b, torch.randn(3, 4), loss_fn=lambda o: o.pow(2).sum())
    # PyTorch drops the gradient hook of '1''s output view when the ReLU changes it in place:
    # the gradient is taken from the node that made the output instead (the run kept exact: no
    # alias in place of the view), so it is compared like any other, and nothing is lost
    assert report.row("1").grad_error == 0.0  # the same downstream code: the same gradient
    assert not any("no gradient recorded" in n for n in report.notes)
    assert not report.row("1").note and not report.row("3").note
    assert report.culprit == "1"
    same = hs.compare(a, copy.deepcopy(a), torch.randn(3, 4), loss_fn=lambda o: o.pow(2).sum())
    assert same.culprit is None


class _UsesChildWeight(nn.Module):
    """The caller uses its child's weight itself (``h @ lin.weight``, as a language model whose
    output projection is ``h @ embed.weight.T`` without a module of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
        self.k = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).tanh()
        return self.out(h) + self.k * (h @ self.lin.weight)


@pytest.mark.parametrize("k", [1.0, 1.01])
def test_a_parameter_used_outside_its_modules_calls(monkeypatch, k):
    torch.manual_seed(0)
    a = _UsesChildWeight()
    b = copy.deepcopy(a)
    b.k = k
    fast, _, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    want = None if k == 1.0 else ""
    assert fast.culprit == want and slow.culprit == want


class _IgnoresReturn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.act(y)  # works in place on y; the return value is not used
        return self.out(y)


def test_a_call_that_works_in_place_on_what_its_caller_keeps(monkeypatch):
    torch.manual_seed(0)
    a = _IgnoresReturn()
    fast, _, slow = _both(
        monkeypatch, a, copy.deepcopy(a), torch.randn(3, 4), loss_fn=lambda o: o.sum()
    )
    assert fast.culprit is None and slow.culprit is None


class _HalfGradUse(_UsesChildWeight):
    """The same forward; the gradient of the caller's own use of ``lin.weight`` is halved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).tanh()
        return self.out(h) + self.k * (h @ _ScaledGrad.apply(self.lin.weight, 0.5))


def test_a_parameter_used_outside_its_modules_calls_is_on_its_callers_row(monkeypatch):
    """The one pass sees the gradient that reaches ``lin.weight`` outside ``lin``'s calls: ``lin``
    and its caller replay by themselves, ``lin``'s row compares its own gradient with A's replay
    (exactly 0 here) and the caller's row holds the use (a fault in it is the caller's)."""
    torch.manual_seed(0)
    a = _UsesChildWeight()
    b = copy.deepcopy(a)
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not forced.void and forced.used_outside == {"lin.weight"}
    assert {"lin", ""} <= forced.unforced and "out" not in forced.unforced
    assert fast.row("lin").local_grad_error == slow.row("lin").local_grad_error == 0.0
    _rows_agree(fast, slow)
    b2 = _HalfGradUse()
    b2.load_state_dict(a.state_dict())
    fast, _, slow = _both(monkeypatch, a, b2, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert fast.culprit == slow.culprit == ""
    assert fast.row("").flagged == "backward" and not fast.row("lin").flagged
    _rows_agree(fast, slow)


class _TiedByHand(nn.Module):
    """A language model whose output projection is ``h @ embed.weight.T`` (no module of its
    own): the embedding's weight gets most of its gradient outside the embedding's call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mix = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(ids)).tanh() @ (self.scale * self.embed.weight).T


@pytest.mark.parametrize("scale", [1.0, 1.01])
def test_a_tied_embedding_used_by_hand(monkeypatch, scale):
    torch.manual_seed(0)
    a = _TiedByHand()
    b = copy.deepcopy(a)
    b.scale = scale
    ids = torch.randint(0, 10, (2, 5))
    fast, forced, slow = _both(monkeypatch, a, b, ids, loss_fn=lambda o: o.pow(2).sum())
    assert forced.used_outside == {"embed.weight"}
    assert fast.culprit == slow.culprit == (None if scale == 1.0 else "")
    assert not fast.row("embed").flagged and not slow.row("embed").flagged
    _rows_agree(fast, slow)


class _OneParameterTwoNames(nn.Module):
    """One parameter registered under two names of one module (``self.w2 = self.w1``)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 4))
        self.w2 = self.w1
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x @ self.w1 + (x @ self.w2).tanh())


@pytest.mark.parametrize("change", [None, "bf16", "scale"])
def test_a_parameter_under_two_names_of_one_module(monkeypatch, change):
    """The one pass gave each name its own leaf, so the module's gradient for its first name
    was one use's, against A's whole ``.grad`` (both uses): a fault-free copy named the model
    (local gradient error 0.24). One leaf per parameter: both uses, as A counts them."""
    torch.manual_seed(0)
    a = _OneParameterTwoNames()
    b = copy.deepcopy(a)
    if change == "bf16":
        b = b.to(torch.bfloat16)
    if change == "scale":
        with torch.no_grad():
            b.w1.mul_(1.01)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=loss)
    assert not forced.void and not forced.dirty and len(forced.results) == len(fast.rows)
    assert fast.culprit == slow.culprit == ("" if change == "scale" else None)
    if change is None:
        assert fast.row("").local_grad_error == 0.0 and fast.row("").param_grad_error == 0.0
    _rows_agree(fast, slow)


def _encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()


def test_multihead_attention_uses_out_proj_without_calling_it(monkeypatch):
    """``nn.MultiheadAttention`` passes ``out_proj.weight`` to a function (``out_proj`` is never
    called): a fault-free pair names nothing, a fault in that weight is the attention's. The one
    pass gives that weight's gradient to the attention's calls (the child never runs as a
    module: its parameters are swapped for leaves during its parent's calls), so every row
    stays in the one pass."""
    a = _encoder_layer()
    x = torch.randn(2, 5, 8)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    fast, forced, slow = _both(monkeypatch, a, copy.deepcopy(a), x, loss_fn=loss)
    assert not forced.void and not forced.used_outside and not forced.unforced
    assert forced.adopted == {"self_attn": ["out_proj.weight", "out_proj.bias"]}
    assert fast.culprit is None and slow.culprit is None
    _rows_agree(fast, slow)
    b = copy.deepcopy(a)
    b.self_attn.out_proj.weight.data.mul_(1.01)
    fast, _, slow = _both(monkeypatch, a, b, x, loss_fn=loss)
    assert fast.culprit == slow.culprit == "self_attn"
    _rows_agree(fast, slow)


def test_gpt2_with_tied_weights_names_nothing(monkeypatch):
    from helpers.faults import lm_loss
    from helpers.lm import tiny_gpt2

    a = tiny_gpt2(n_layer=2, n_embd=32, n_head=2)
    ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    kw = {"use_cache": False}
    fast, forced, slow = _both(monkeypatch, a, copy.deepcopy(a), ids, loss_fn=lm_loss, **kw)
    assert not forced.void
    assert fast.culprit is None and slow.culprit is None
    _rows_agree(fast, slow)


class _Leaky(nn.Module):
    """An in-place activation with a wrong slope (the fault) that returns its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu_(x, 0.01)


def test_a_fault_in_a_child_that_works_in_place_is_named(monkeypatch):
    torch.manual_seed(0)
    a = _IgnoresReturn()
    b = copy.deepcopy(a)
    b.act = _Leaky()
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert not forced.void and not forced.dirty
    assert fast.culprit == slow.culprit == "act"
    assert not fast.row("").flagged and not slow.row("").flagged
    _rows_agree(fast, slow)
    # forward only: the same
    fast, _, slow = _both(monkeypatch, a, b, torch.randn(3, 4))
    assert fast.culprit == slow.culprit == "act"


class _AddsInPlace(nn.Module):
    """Changes its input in place and returns another tensor: what its caller keeps after the
    call is not recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(self.shift)
        return x * 2


class _KeepsChanged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.f, self.out = nn.Linear(4, 4), _AddsInPlace(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = self.f(y)
        return self.out(y + z)


def test_a_call_that_changes_its_input_and_returns_another_runs_in_its_callers_replay(
    monkeypatch,
):
    torch.manual_seed(0)
    a = _KeepsChanged()
    fast, forced, slow = _both(
        monkeypatch, a, copy.deepcopy(a), torch.randn(3, 4), loss_fn=lambda o: o.sum()
    )
    assert 0 in forced.dirty  # the caller (the model) replays by itself
    assert fast.culprit is None and slow.culprit is None
    for rep in (fast, slow):
        assert "change an input in place" in rep.row("").note and "f" in rep.row("").note
        assert any(n.startswith("<root>: its local error includes") for n in rep.notes)
    _rows_agree(fast, slow)


class _DetachesInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.detach = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.detach() if self.detach else y


def test_a_module_that_stops_the_gradient_is_found(monkeypatch):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _DetachesInside(), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[1].detach = True
    fast, _, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert fast.culprit == slow.culprit == "1"


def test_a_forward_hook_is_its_modules(monkeypatch):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    b = copy.deepcopy(a)
    b[0].register_forward_hook(lambda m, i, o: o * 1.01)
    fast, _, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert fast.culprit == slow.culprit == "0"


def test_a_parameter_used_outside_its_calls_against_a_record_is_said(tmp_path):
    """Against a record of A there is no A to replay: the gradients of a parameter used outside
    its module's calls are not compared (A's .grad holds every use), and the rows say so."""
    torch.manual_seed(0)
    a = _UsesChildWeight()
    x = torch.randn(3, 4)
    with hs.record(a, tmp_path):
        a(x).sum().backward()
    a.zero_grad(set_to_none=True)
    r = hs.compare(str(tmp_path), copy.deepcopy(a), x, loss_fn=lambda o: o.sum())
    assert r.culprit is None
    for name in ("lin", ""):
        assert "parameter gradients not compared" in r.row(name).note, name


class _NoOutsideUse(_UsesChildWeight):
    """The caller without its own use of ``lin.weight`` (the fault, or A's model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x).tanh())


@pytest.mark.parametrize("a_uses", [True, False])
def test_an_outside_use_in_one_run_only_is_the_callers(monkeypatch, a_uses):
    """Where only A uses ``lin.weight`` outside ``lin``'s calls the one pass (on B) cannot see it:
    ``lin``'s gradient, off A's whole ``.grad`` by that use, is checked again against A's own
    replay of ``lin`` (exactly 0); the caller, whose output differs, is named."""
    torch.manual_seed(0)
    uses, plain = _UsesChildWeight(), _NoOutsideUse()
    plain.load_state_dict(uses.state_dict())
    a, b = (uses, plain) if a_uses else (plain, uses)
    fast, _, slow = _both(monkeypatch, a, b, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert fast.culprit == slow.culprit == ""
    assert fast.row("lin").local_grad_error == slow.row("lin").local_grad_error == 0.0
    _rows_agree(fast, slow)


class _Chain(nn.Module):
    """torchvision's MBConv pattern: a container's output handed through an identity module,
    then changed in place by the caller (``result += input``)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Tanh(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        self.skip = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.skip(self.block(x))
        r += x
        return r


def test_a_gradient_lost_through_views_of_views_leaves_no_false_culprit_and_says_so():
    """The caller's ``r += x`` changes a value handed on through views of views (the container's
    output, the identity's input and output): PyTorch hands no gradient to any of them, so the
    rows whose local backward would miss that path get none, with a note saying why (the
    caller, which got no input gradient back from the identity, was named in an exact copy);
    the leaves' own gradients are taken from the graph (exact: zero in a copy), and a fault in
    one of them is named."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), _Chain(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    same = hs.compare(a, copy.deepcopy(a), x, loss_fn=loss)
    assert same.culprit is None
    row = same.row("1")
    assert row.local_grad_error is None and "lacks the input gradient of 1.skip#0" in row.note
    assert same.row("1.block.0").local_grad_error == 0.0
    assert same.row("1.block.1.0").local_grad_error == 0.0
    assert same.row("1.block.1.1").local_grad_error == 0.0  # its output: recovered exactly
    b = copy.deepcopy(a)
    b[1].block[1][0].__class__ = _BadBackward
    assert hs.compare(a, b, x, loss_fn=loss).culprit == "1.block.1.0"


class _Fan(nn.Module):
    """Recorded tensors read by several calls: ``h`` (``a``'s output, the input of ``b`` and of
    ``c``), ``u`` (``b``'s output, the input of ``relu``, which works on it in place) and the
    model's input (its own call's and ``a``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        u, w = self.b(h), self.c(h)
        return self.relu(u) * w + h


@pytest.mark.parametrize("variant", ["fp32", "bf16", "fault"])
def test_a_value_many_calls_read_is_handed_to_each_as_its_own(monkeypatch, variant):
    """The one pass casts each recorded value once and hands it to the calls that read it; the
    last of them takes the cast itself, the others copies (a call working in place on what it
    got must not change what the next one gets): every row as the per-call replay gives it."""
    torch.manual_seed(0)
    a = _Fan()
    b = copy.deepcopy(a)
    if variant == "fault":
        with torch.no_grad():
            b.c.weight.mul_(1.01)
    if variant == "bf16":
        b = b.to(torch.bfloat16)
    fast, forced, slow = _both(monkeypatch, a, b, torch.randn(5, 8), loss_fn=lambda o: o.sum())
    assert not forced.void
    _rows_agree(fast, slow)
    assert fast.culprit == ("c" if variant == "fault" else None)
    if variant == "fp32":
        assert all(r.local_error == 0.0 for r in fast.rows)


def test_the_cast_cache_hands_a_cast_over_at_its_tensor_s_last_read_only():
    """_Casts counts each recorded tensor's reads (one per call whose inputs or output hold
    it): before the last, the cast stays cached (copied by whoever takes it); at the last it
    leaves the cache for ``last``; a read past the count finds nothing and is cast afresh."""
    from types import SimpleNamespace

    _forced = importlib.import_module("hookscope.compare._forced")
    t, once = torch.randn(3), torch.randn(2)
    calls = [
        SimpleNamespace(inputs=((t, t), {}), output=t),  # its inputs read once, its output once
        SimpleNamespace(inputs=((t, once), {}), output=None),
    ]
    casts = _forced._Casts(calls)
    assert casts.left == {id(t): 3, id(once): 1}
    key, c = (id(t), torch.float32), t.clone()
    assert casts.get(key) is None
    casts[key] = (t, c)  # first read: cached
    assert dict.get(casts, key) is not None and not casts.last
    assert casts.get(key) == (t, c) and not casts.last  # second read: still cached
    assert casts.get(key) == (t, c) and casts.last == {id(c): c}  # last read: handed over
    assert dict.get(casts, key) is None and casts.get(key) is None  # past the count: afresh
    casts[(id(once), torch.float32)] = (once, once.clone())  # its only read: never cached
    assert dict.get(casts, (id(once), torch.float32)) is None and len(casts.last) == 2
