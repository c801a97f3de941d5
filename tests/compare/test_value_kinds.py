"""hs.compare on values of other kinds than real dense tensors in tuples, lists, dicts and
dataclasses: complex outputs and buffers, sparse gradients, and tensors a
module returns inside an object of its own. Each was silently wrong or crashed: an exact copy of
a model with an FFT layer had its next module named (complex values compared as integers, their
gradients cut), a bf16 copy whose cast dropped a complex rotary table's imaginary part was
excused as ill-conditioned (the reference was cast the same way), a sparse embedding gradient
raised from inside the norms, and a module returning ``Box(h)`` with a fault had no culprit and
no word of why. Each error is checked against a hand-computed norm ratio."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.compare._tolerance import Norms, rel_error
from hookscope.core._nested import continuous, hidden_tensors


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float((got - ref).norm() / ref.norm())


def _quiet_compare(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = hs.compare(*args, **kwargs)
    return report, [str(w.message) for w in caught if issubclass(w.category, hs.HookscopeWarning)]


# -- complex values --------------------------------------------------------------------------------
class _Fourier(nn.Module):
    def __init__(self, imag: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.imag = imag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.fft(self.lin(x), dim=-1)
        return torch.complex(z.real, z.imag * self.imag) if self.imag != 1.0 else z


class _Head(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.real + z.imag


class _Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.h, self.out = _Fourier(), _Head(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.h(self.f(x)))


def test_complex_outputs_compare_by_their_norms_and_carry_gradients():
    """An exact copy differs by exactly 0 everywhere (its next module was named: the complex
    output compared as integers, its gradient marked non-differentiable in the replay); a
    fault in the imaginary part is named, with its error the norm ratio of the complex values."""
    torch.manual_seed(0)
    a, x = _Spectral(), torch.randn(4, 8)
    report = hs.compare(a, copy.deepcopy(a), x, loss_fn=_loss)
    assert report.culprit is None and report.first_divergent is None, report
    for r in report.rows:
        assert r.error == 0.0 and r.local_error == 0.0, r
        assert r.grad_error == 0.0 and r.local_grad_error == 0.0, r

    b = copy.deepcopy(a)
    b.f.imag = 1.01
    report = hs.compare(a, b, x, loss_fn=_loss)
    assert report.culprit == "f" and report.first_divergent == "f", report
    with torch.no_grad():
        za, zb = a.f(x), b.f(x)
    want = float((zb - za).abs().pow(2).sum().sqrt() / za.abs().pow(2).sum().sqrt())
    assert report.row("f").error == pytest.approx(want, rel=1e-5)
    assert report.row("h").local_error == 0.0


def test_norms_of_complex_and_sparse_values_are_those_of_their_values():
    z = torch.randn(5, 3, dtype=torch.complex64)
    w = z + 0.01 * torch.randn(5, 3, dtype=torch.complex64)
    assert continuous(z) and not continuous(torch.zeros(1, dtype=torch.int64))
    assert rel_error(z, w) == pytest.approx(
        _rel(torch.view_as_real(z), torch.view_as_real(w)), 1e-6
    )
    assert rel_error(z, z.clone()) == 0.0
    # a conjugate view: its values, not its memory (imaginary parts negated)
    conj = z.conj()
    want = _rel(torch.view_as_real(z), torch.view_as_real(conj.resolve_conj()))
    assert rel_error(z, conj) == pytest.approx(want, rel=1e-6) and want > 0
    # a complex value against a real one: the structures differ
    assert rel_error(z, z.real.contiguous()) == float("inf")
    dense = torch.zeros(6, 4)
    dense[1, 2], dense[4, 0] = 3.0, -1.0
    other = dense.clone()
    other[4, 0] = -1.5
    got = rel_error(dense.to_sparse(), other.to_sparse())
    assert got == pytest.approx(_rel(dense, other), rel=1e-6)
    norms = Norms()
    lazy = norms.rel_pairs([(z, w), (dense.to_sparse(), other)])
    norms.resolve()
    num = (torch.view_as_real(w) - torch.view_as_real(z)).double().pow(2).sum() + (
        (other - dense).double().pow(2).sum()
    )
    den = torch.view_as_real(z).double().pow(2).sum() + dense.double().pow(2).sum()
    assert lazy.get() == pytest.approx(float((num / den).sqrt()), rel=1e-6)


class _Rope(nn.Module):
    """Rotary embedding the way Meta's Llama code writes it: a complex table, the features
    multiplied as complex numbers."""

    def __init__(self, base: float = 10000.0, n: int = 6, d: int = 8) -> None:
        super().__init__()
        f = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
        t = torch.arange(n).float()
        self.register_buffer("cis", torch.polar(torch.ones(n, d // 2), torch.outer(t, f)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * self.cis).flatten(-2).type_as(x)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.rope, self.o = nn.Linear(8, 8), _Rope(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.rope(self.q(x)))


def test_a_complex_table_a_bf16_cast_made_real_is_named_not_excused():
    """``copy.deepcopy(a).to(torch.bfloat16)`` turns the complex rotary table into a real one
    (PyTorch drops its imaginary part): B's rope is broken. It was excused as ill-conditioned
    because the reference (A's module in bf16) was cast the same way; the reference now keeps
    complex tensors, the rope is named and a warning says which tensor and why."""
    torch.manual_seed(0)
    a, x = _Attn(), torch.randn(2, 6, 8)
    fine = copy.deepcopy(a)
    fine._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    report, said = _quiet_compare(a, fine, x, loss_fn=_loss)
    assert report.culprit is None and not said, (report, said)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's own, on the cast
        broken = copy.deepcopy(a).to(torch.bfloat16)
    assert not broken.rope.cis.is_complex()
    report, said = _quiet_compare(a, broken, x, loss_fn=_loss)
    assert report.culprit == "rope", report
    assert any("'rope.cis' (complex64 in a, bfloat16 in b)" in s for s in said), said
    # a fault in the table's frequencies of a bf16 B is named too (it was excused the same way)
    b = copy.deepcopy(fine)
    b.rope = _Rope(base=500.0)
    report, _ = _quiet_compare(a, b, x, loss_fn=_loss)
    assert report.culprit == "rope", report


# -- sparse gradients ------------------------------------------------------------------------------
class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.out = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def test_sparse_parameter_gradients_compare_as_their_dense_values(tmp_path):
    """``nn.Embedding(sparse=True)``: compare raised ``reshape is not implemented for sparse
    tensors``. An exact copy differs by 0, a changed row is named, and the parameter gradient
    error is the dense gradients' norm ratio; a record compares the same way."""
    torch.manual_seed(0)
    a = _Bag()
    ids = torch.tensor([[1, 4, 4, 7], [2, 9, 1, 3]])
    report = hs.compare(a, copy.deepcopy(a), ids, loss_fn=_loss)
    assert report.culprit is None and report.row("emb").param_grad_error == 0.0, report
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.emb.weight[4] *= 1.5
    report = hs.compare(a, b, ids, loss_fn=_loss)
    assert report.culprit == "emb", report
    grads = []
    for m in (a, b):
        m.zero_grad(set_to_none=True)
        _loss(m(ids)).backward()
        assert m.emb.weight.grad.is_sparse
        grads.append(m.emb.weight.grad.to_dense())
        m.zero_grad(set_to_none=True)
    assert report.row("emb").param_grad_error == pytest.approx(_rel(*grads), rel=1e-5)
    folder = tmp_path / "rec"
    with hs.record(a, folder):
        _loss(a(ids)).backward()
    a.zero_grad(set_to_none=True)
    again = hs.compare(str(folder), b, ids, loss_fn=_loss)
    assert again.culprit == "emb"
    assert again.row("emb").param_grad_error == pytest.approx(_rel(*grads), rel=1e-5)


# -- tensors inside objects ------------------------------------------------------------------------
class _Box:
    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.k = 1.0

    def forward(self, x: torch.Tensor) -> _Box:
        return _Box(torch.tanh(self.lin(x)) * self.k)


class _Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.out = _Enc(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(x).h)


def test_tensors_a_module_returns_inside_an_object_are_compared_and_a_fault_there_is_said():
    """``enc`` returns ``Box(h)``: its row had no error, a local error of 0.0, and a fault in it
    left no culprit, with ``out`` the first divergent module and nothing said. The row's error
    now covers the tensors inside (the hand-computed norm ratio), its local error is unknown
    (the replays cannot hand such values on), and a warning names the module and the fix."""
    torch.manual_seed(0)
    a, x = _Boxed(), torch.randn(4, 8)
    report, said = _quiet_compare(a, copy.deepcopy(a), x, loss_fn=_loss)
    assert report.culprit is None and not said
    assert report.row("enc").error == 0.0
    b = copy.deepcopy(a)
    b.enc.k = 1.05
    report, said = _quiet_compare(a, b, x, loss_fn=_loss)
    with torch.no_grad():
        want = _rel(a.enc(x).h, b.enc(x).h)
    row = report.row("enc")
    assert row.error == pytest.approx(want, rel=1e-5) and want > row.tol
    assert row.local_error is None and "_Box" in row.note, row
    assert report.first_divergent == "enc", report
    assert any("'enc'" in s and "tuple, dict or dataclass" in s for s in said), said
    assert any("'enc'" in n for n in report.notes)


def test_hidden_tensors_walks_objects_but_not_modules_and_counts_each_object_once():
    class Slotted:
        __slots__ = ("t",)

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    x, y = torch.ones(1), torch.zeros(2)
    box = _Box([x, {"y": y}])
    ts, classes = hidden_tensors({"a": box, "b": (box, Slotted(y), nn.Linear(1, 1), x)})
    assert [t is x for t in ts] == [True, False, False] and ts[1] is y and ts[2] is y
    assert classes == ["_Box", "Slotted"]
    assert hidden_tensors((x, [y], {"k": x})) == ([], [])


@pytest.mark.skipif(os.name != "posix", reason="posix only")
def test_a_fault_free_bf16_transformer_with_its_cache_in_the_output_names_nothing():
    """A Llama returning its ``DynamicCache`` (use_cache=True): the cache's tensors now count in
    the model's row error; a fault-free bf16 copy stays silent and names nothing."""
    from helpers.faults import _reinit
    from helpers.lm import tiny_llama

    m = _reinit(tiny_llama(), 0).eval()
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss(o):
        return o.logits.float().logsumexp(-1).mean()

    report, said = _quiet_compare(m, copy.deepcopy(m).to(torch.bfloat16), ids, loss_fn=loss,
                                  use_cache=True)  # fmt: skip
    assert report.culprit is None and not said, (report, said)
    assert 0 < report.row("").error < report.row("").tol


def test_a_cache_a_fault_inside_the_model_changes_is_said_on_its_rows_without_a_warning():
    """A prefilled ``DynamicCache`` returned by the model: a fault in ``v_proj`` changes the
    cache's values too. The culprit is named; the rows of the calls returning the cache say so,
    and no warning claims that the culprit may be unnamed (the fault inside explains it)."""
    import transformers

    from helpers.faults import _reinit
    from helpers.lm import tiny_llama

    m = _reinit(tiny_llama(), 0).eval()
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss(o):
        return o.logits.float().logsumexp(-1).mean()

    cache = transformers.DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids[:, :8], past_key_values=cache, use_cache=True)
    b = copy.deepcopy(m)
    with torch.no_grad():
        b.model.layers[1].self_attn.v_proj.weight.mul_(1.2)
    report, said = _quiet_compare(m, b, ids[:, 8:], loss_fn=loss, past_key_values=cache,
                                  use_cache=True)  # fmt: skip
    assert report.culprit == "model.layers.1.self_attn.v_proj", report
    assert not said, said
    assert "DynamicCache" in report.row("model").note
    # its error covers its hidden states and its cache (both changed by the fault)
    assert report.row("model").error > report.row("model").tol


class _Clears(nn.Module):
    """Reads ``enc``'s box, then empties it (``box.h = zeros``) after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.out = _Enc(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box = self.enc(x)
        y = self.out(box.h)
        box.h = torch.zeros_like(box.h)
        return y


def test_an_object_a_call_returned_is_kept_as_it_was_when_the_call_ended():
    """The record kept ``enc``'s returned object itself, which its caller emptied afterwards:
    both runs' rows read zeros, ``enc``'s error was 0.0 and the fault was blamed on the root.
    Objects among an output are copied when the call ends (as among the inputs)."""
    torch.manual_seed(0)
    a, x = _Clears(), torch.randn(4, 8)
    b = copy.deepcopy(a)
    b.enc.k = 1.05
    report, said = _quiet_compare(a, b, x, loss_fn=_loss)
    with torch.no_grad():
        want = _rel(a.enc(x).h, b.enc(x).h)
    assert report.row("enc").error == pytest.approx(want, rel=1e-5) and want > 0.01
    assert report.culprit != "" and report.first_divergent == "enc", report
    assert any("'enc'" in s for s in said), said


def _quantized_pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch's deprecation of torch.ao quantization)
        b = torch.ao.quantization.quantize_dynamic(copy.deepcopy(a), {nn.Linear}, torch.qint8)
    return a, b, torch.randn(4, 32)


def test_a_dynamically_quantized_b_is_said_and_its_gradients_are_refused():
    """``quantize_dynamic``'s int8 Linear layers add quantization's error (measured here by hand:
    the first layer's output against A's, ~1e-2, far above float32's tolerance): compare named
    them with float32 tolerances and said nothing of why. With ``loss_fn``, PyTorch's quantized
    kernel has no backward (the gradient of its input is None, checked by hand), so every
    gradient before it would be missing and compared nowhere, silently: refused by name."""
    a, b, x = _quantized_pair()
    with torch.no_grad():
        by_hand = float((b[0](x) - a[0](x)).norm() / a[0](x).norm())
    assert by_hand > 1e-3
    with pytest.warns(hs.HookscopeWarning, match=r"'0', '2' \(torch\.ao\.nn\.quantized\.dynamic"):
        report = hs.compare(a, b, x)
    assert report.culprit == "0" and abs(report.row("0").local_error - by_hand) < 1e-6
    assert any("quantized" in n for n in report.notes)
    xg = x.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b(xg).sum().backward()
    assert xg.grad is None  # (the gradient stops at the quantized kernel)
    with pytest.raises(hs.CompareError, match=r"quantized modules '0', '2'.*no backward"):
        hs.compare(a, b, x, loss_fn=lambda o: o.pow(2).sum())


def test_a_record_of_a_backward_through_quantized_modules_is_refused(tmp_path):
    """hs.record of a quantized model with a backward in the block: no gradient reached the
    modules before the quantized ones (None, as PyTorch's kernel has no backward), so the record
    would hold gradients missing where a comparison reads them as not given: refused, nothing
    written. A forward-only record is made and compares (forward) with the float model."""
    a, b, x = _quantized_pair()
    x = x.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch: no autograd kernel for the quantized op)
        with (
            pytest.raises(hs.CompareError, match=r"quantized modules '0', '2'"),
            hs.record(b, tmp_path / "grads"),
        ):
            b(x).pow(2).sum().backward()
    assert not (tmp_path / "grads" / "index.json").exists()
    b.zero_grad(set_to_none=True)
    with hs.record(b, tmp_path / "fwd"):
        b(x)
    with pytest.warns(hs.HookscopeWarning, match=r"b's modules '0', '2' \(torch\.ao"):
        report = hs.compare(a, tmp_path / "fwd", x.detach())
    assert report.first_divergent == "0" and any("quantized" in n for n in report.notes)
