"""The fault suite: single-module faults across a Llama-style decoder (GQA, RoPE, RMSNorm), a CNN
with BatchNorm and a ViT, each named by hs.compare under fp32 and bf16 runs; no culprit in any
fault-free pair (fp32 copy, bf16 copy, bf16 autocast, compiled)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.faults import FAULTS, MODELS, CompiledOnly, faulty, relative_effect


@functools.cache
def _model(name: str):
    return MODELS[name]()


def _run(a, b, model: str, autocast=None):
    _, inputs, kwargs, loss = _model(model)
    return hs.compare(a, b, *inputs, loss_fn=loss, autocast=autocast, **kwargs)


def test_the_suite_has_twenty_faults_across_three_models_each_with_a_visible_effect():
    assert len(FAULTS) >= 20 and {f.model for f in FAULTS} == {"llama", "cnn", "vit"}
    assert len({f.id for f in FAULTS}) == len(FAULTS)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_each_fault_is_named_in_fp32(fault):
    a = _model(fault.model)[0]
    b = faulty(a, fault)
    r = _run(a, b, fault.model)
    assert r.culprit == fault.culprit, (r.culprits, str(r))
    assert r.culprits == [fault.culprit]


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f for f in FAULTS if f.bf16], ids=lambda f: f.id)
@pytest.mark.parametrize("variant", ["bf16", "autocast"])
def test_each_fault_is_named_against_a_bf16_run(fault, variant):
    a = _model(fault.model)[0]
    b = faulty(a, fault)
    if variant == "bf16":
        r = _run(a, b.to(torch.bfloat16), fault.model)
    else:
        r = _run(a, b, fault.model, autocast=torch.bfloat16)
    assert r.culprit == fault.culprit, (r.culprits, str(r))


def test_fault_effects_are_above_the_sizes_that_must_be_named():
    # a change of >= 1e-3 (fp32) or >= 5e-2 (bf16) of its module's output must be named; the
    # suite's faults are at least that (the backward-only ones change no output)
    for fault in FAULTS:
        a, inputs, kwargs, _ = _model(fault.model)
        if "backward" in fault.id or fault.id == "vit-pos-embedding":
            continue
        effect = relative_effect(a, faulty(a, fault), fault.culprit, inputs, kwargs)
        assert effect >= (5e-2 if fault.bf16 and "final" not in fault.id else 1e-3), fault.id


@pytest.mark.parametrize("model", ["llama", "cnn", "vit"])
@pytest.mark.parametrize("variant", ["fp32", "bf16", "autocast"])
def test_fault_free_pairs_name_no_culprit(model, variant):
    a = _model(model)[0]
    b = copy.deepcopy(a)
    if variant == "bf16":
        b = b.to(torch.bfloat16)
    r = _run(a, b, model, autocast=torch.bfloat16 if variant == "autocast" else None)
    assert r.culprit is None, str(r)
    if variant == "fp32":  # an exact copy: exactly zero, forward and backward
        assert all(x.error == 0 and x.local_error == 0 for x in r.rows)
        assert all(x.local_grad_error in (0, None) for x in r.rows)
    else:  # fault-free bf16 modules stay well inside the tolerance
        assert max(x.local_error / x.tol for x in r.rows) < 0.5


def _tiny() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16))


def test_eager_against_compiled_names_no_culprit_and_a_compiled_only_fault_is_named():
    a = _tiny()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    b = torch.compile(copy.deepcopy(a), backend="aot_eager")
    r = hs.compare(a, b, x, loss_fn=loss)
    assert r.culprit is None and r.unmatched == []
    assert [row.label for row in r.rows] == ["<root>", "0", "1", "2", "3"]  # eager names
    assert all(row.compile_error is not None and row.compile_error <= 5e-7 for row in r.rows)
    # a module whose output is off only inside the compiled program
    bad = copy.deepcopy(a)
    bad[2] = CompiledOnly(bad[2])
    ref = copy.deepcopy(bad)  # the same modules, eager: its local errors are all zero
    r = hs.compare(ref, torch.compile(bad, backend="aot_eager"), x, loss_fn=loss)
    assert r.culprit == "2" and r.row("2").flagged == "compiled"
    assert r.row("2").compile_error == pytest.approx(0.1, rel=1e-5)
    assert r.row("2").local_error == 0.0  # B's module run eagerly is right


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "cnn", "vit"])
def test_eager_against_inductor_names_no_culprit(model):
    a, inputs, kwargs, loss = _model(model)
    b = torch.compile(copy.deepcopy(a))
    r = hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
    assert r.culprit is None, str(r)
    assert max(x.compile_error or 0 for x in r.rows) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "vit"])
def test_a_compiled_only_fault_is_named_in_a_compiled_transformer(model):
    a, inputs, kwargs, loss = _model(model)
    name = {"llama": "model.layers.1.mlp", "vit": "encoder.layers.encoder_layer_0.mlp"}[model]
    bad = copy.deepcopy(a)
    parent, _, attr = name.rpartition(".")
    setattr(bad.get_submodule(parent), attr, CompiledOnly(bad.get_submodule(name)))
    r = hs.compare(copy.deepcopy(bad), torch.compile(bad, backend="aot_eager"), *inputs,
                   loss_fn=loss, **kwargs)  # fmt: skip
    assert r.culprit == name and r.row(name).flagged == "compiled"
