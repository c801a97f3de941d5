"""Audit of hs.compare, session 17: models as users hand them over (wrapped in
``nn.DataParallel``), each checked against a plain run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def _net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8))
    return net, torch.randn(4, 8)


def test_a_model_wrapped_in_data_parallel_is_compared_as_the_model_it_wraps(tmp_path):
    """``nn.DataParallel(b)``: every name carried a ``module.`` prefix, nothing paired but the
    root, and a fault in ``2`` was blamed on the whole model. The wrapper is now set aside, on
    either side and in a record, and the fault is named with the plain runs' error."""
    a, x = _net()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[2].weight[0, 0] += 1.0
    report = hs.compare(a, nn.DataParallel(b), x, loss_fn=_loss)
    assert report.unmatched == [] and report.culprit == "2", report
    with torch.no_grad():
        h = a[1](a[0](x))
        want = float((b[2](h) - a[2](h)).norm() / a[2](h).norm())
    assert report.row("2").local_error == pytest.approx(want, rel=1e-5)
    again = hs.compare(nn.DataParallel(a), b, x, loss_fn=_loss)
    assert again.culprit == "2" and again.row("2").local_error == pytest.approx(want, rel=1e-5)
    dp = nn.DataParallel(a)
    with hs.record(dp, tmp_path / "rec"):
        _loss(dp(x)).backward()
    a.zero_grad(set_to_none=True)
    recorded = hs.compare(str(tmp_path / "rec"), b, x, loss_fn=_loss)
    assert recorded.unmatched == [] and recorded.culprit == "2", recorded
    assert hs.compare(a, nn.DataParallel(copy.deepcopy(a)), x, loss_fn=_loss).culprit is None


class _Mixed(nn.Module):
    """An embedding kept in fp32 (the model's first parameter) and the rest cast to the
    layers' dtype: a mixed-precision model once ``l1``, ``n`` and ``l2`` are bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 32)
        self.l1, self.n, self.l2 = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).to(self.l1.weight.dtype)
        return self.l2(torch.relu(self.n(self.l1(h))))


def test_a_mixed_precision_copy_is_judged_in_the_dtype_each_module_computes_in():
    """B's first parameter (the embedding) is fp32 and its other modules bf16: B read as an
    fp32 model, every bf16 module was judged against fp32's tolerance and a fault-free copy had
    ``l1`` as its culprit. Each row's tolerance is now that of the lowest dtype its call
    computed in; a fault in a bf16 module is still named, and the report says which modules."""
    torch.manual_seed(0)
    a, ids = _Mixed(), torch.randint(0, 30, (2, 6))
    b = copy.deepcopy(a)
    for m in (b.l1, b.n, b.l2):
        m.to(torch.bfloat16)
    report = hs.compare(a, b, ids, loss_fn=_loss)
    assert report.culprit is None, report
    assert report.dtypes == ("float32", "float32")
    assert report.row("emb").tol < 1e-4 < 1e-2 < report.row("l1").tol
    with torch.no_grad():  # what bf16 rounding does to l1 on A's own inputs: within its tolerance
        h = a.emb(ids)
        want = float((b.l1(h.bfloat16()).float() - a.l1(h)).norm() / a.l1(h).norm())
    assert report.row("l1").local_error == pytest.approx(want, rel=1e-3)
    assert 1e-4 < want < report.row("l1").tol
    assert any("'l1'" in n and "bfloat16" in n for n in report.notes), report.notes
    for fault in ("weight", "eps"):
        bad = copy.deepcopy(b)
        if fault == "weight":
            with torch.no_grad():
                bad.l1.weight.mul_(1.1)
        else:
            bad.n.eps = 0.5
        assert hs.compare(a, bad, ids, loss_fn=_loss).culprit == (
            "l1" if fault == "weight" else "n"
        )


class _MixedNorm(nn.Module):
    """A BatchNorm over two values in training mode, on values far from zero: ill-conditioned in
    bf16 (A's own module shows the same error when its inputs are rounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 32)
        self.l1, self.bn, self.l2 = nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).to(self.l1.weight.dtype).mean(1)
        return self.l2(torch.relu(self.bn(self.l1(h) + 20.0)))


def test_an_ill_conditioned_module_of_a_mixed_precision_copy_is_explained_as_in_an_all_bf16_one():
    """The conditioning check ran only where the models' dtypes differ: the same BatchNorm, no
    culprit in an all-bf16 copy, was the culprit of a mixed copy (fp32 embedding first). It now
    runs for each call computed in a lower dtype, with that dtype; a real fault is still named."""
    torch.manual_seed(0)
    a, ids = _MixedNorm().train(), torch.randint(0, 30, (2, 6))
    b = copy.deepcopy(a)
    for m in (b.l1, b.bn, b.l2):
        m.to(torch.bfloat16)
    everything = hs.compare(a, copy.deepcopy(a).bfloat16(), ids, loss_fn=_loss)
    assert everything.culprit is None and "not stable" in everything.row("bn").note
    report = hs.compare(a, b, ids, loss_fn=_loss)
    assert report.culprit is None, report
    row = report.row("bn")
    assert row.local_error > row.tol and "rounding its inputs to bfloat16" in row.note, row
    assert row.local_error == pytest.approx(everything.row("bn").local_error, rel=1e-6)
    bad = copy.deepcopy(b)
    with torch.no_grad():
        bad.l2.weight.mul_(1.1)
    assert hs.compare(a, bad, ids, loss_fn=_loss).culprit == "l2"


def test_an_exact_copy_of_a_decoder_differs_by_exactly_zero_in_its_gradients_too(tmp_path):
    """The fault suite's Llama (RMSNorm inside a residual stream): A's run handed each call
    identity views of its inputs (for their gradients) and B's did not, so a tensor used inside
    a call and outside it had its gradient summed in another order: 20 rows of an exact copy
    differed by ~1e-7. B's run now gets the same views (no hooks): every error is exactly 0,
    live or against a record."""
    from helpers.faults import MODELS

    a, inputs, kwargs, loss = MODELS["llama"]()
    report = hs.compare(a, copy.deepcopy(a), *inputs, loss_fn=loss, **kwargs)
    fields = ("error", "local_error", "grad_error", "local_grad_error", "param_grad_error")
    for r in report.rows:
        assert all(getattr(r, f) in (0.0, None) for f in fields), r
    assert any(r.grad_error == 0.0 for r in report.rows)
    with hs.record(a, tmp_path / "rec"):
        loss(a(*inputs, **kwargs)).backward()
    recorded = {n: p.grad.clone() for n, p in a.named_parameters()}
    a.zero_grad(set_to_none=True)
    again = hs.compare(str(tmp_path / "rec"), copy.deepcopy(a), *inputs, loss_fn=loss, **kwargs)
    for r in again.rows:
        assert all(getattr(r, f) in (0.0, None) for f in fields), r
    # the record's own step: its gradients are a plain step's up to their summation order
    loss(a(*inputs, **kwargs)).backward()
    for n, p in a.named_parameters():
        torch.testing.assert_close(recorded[n], p.grad, rtol=1e-5, atol=1e-7)
    a.zero_grad(set_to_none=True)


def test_outputs_of_another_structure_say_where_and_what_both_have():
    """Eager attention returns its weights, SDPA ``None`` in their place: the attention's error
    was ``inf`` with no word of why. The row now says which output one run has and the other
    has not, and the error of the tensors both have (here the attention output, by hand)."""
    import re

    from helpers.lm import _build

    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    a = _build("LlamaConfig", "LlamaForCausalLM", 0, attn="eager", **sizes)
    b = _build("LlamaConfig", "LlamaForCausalLM", 0, attn="sdpa", **sizes)
    b.load_state_dict(a.state_dict())

    def loss(o):
        return o.logits.float().logsumexp(-1).mean()

    report = hs.compare(a, b, ids, loss_fn=loss, use_cache=False)
    name = "model.layers.0.self_attn"
    row = report.row(name)
    assert row.error == float("inf") and "a returns tensors at [1] (None in the other)" in row.note
    outs = []
    for m in (a, b):
        h = m.get_submodule(name).register_forward_hook(
            lambda mod, i, o: outs.append(o[0].detach())
        )
        try:
            with torch.no_grad():
                m(ids, use_cache=False)
        finally:
            h.remove()
    want = float((outs[1] - outs[0]).double().norm() / outs[0].double().norm())
    said = float(re.search(r"both return differ by ([0-9.e+-]+)", row.note).group(1))
    assert said == pytest.approx(want, rel=0.06, abs=1e-9)  # (the note shows 2 digits)
