"""The README's quick start runs as written and does what its comments say."""

from __future__ import annotations

import pathlib

import torch

import hookscope as hs

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quick_start() -> str:
    text = README.read_text()
    start = text.index("```python", text.index("## Quick start")) + len("```python")
    return text[start : text.index("```", start)]


def test_readme_quick_start_runs_and_its_comments_hold(capsys):
    ns: dict = {}
    exec(compile(_quick_start(), "README.md#quick-start", "exec"), ns)
    model, cap, x = ns["model"], ns["cap"], ns["x"]
    # "output of the last call", "gradient w.r.t. that output", "every call, in order"
    ref = model.layer4(
        model.layer3(
            model.layer2(model.layer1(model.maxpool(model.relu(model.bn1(model.conv1(x))))))
        )
    )
    assert torch.allclose(cap["layer4"], ref, atol=1e-5)
    assert cap.grads["layer4"].shape == ref.shape and cap.grads["layer4"].abs().sum() > 0
    assert [c.index for c in cap.calls("layer1.0.relu")] == [0, 1]
    assert list(ns["feats"]) == ["layer4", "avgpool"]
    assert torch.allclose(ns["feats"]["avgpool"], model.avgpool(ref), atol=1e-5)
    # the trace printed every call; clip_grads' handle is the only hookscope hook left
    assert "fc" in capsys.readouterr().out
    assert {i.feature for i in hs.hooks_on(model)} == {"clip_grads"}
    ns["handle"].remove()
    assert hs.hooks_on(model) == []


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index("```python", text.index(title)) + len("```python")
    return text[start : text.index("```", start)]


def test_readme_activation_patching_runs_and_equals_a_hand_loop():
    """The IOI-style block runs as written; its residual sweep equals a hand-written loop of one
    forward per site (hs.capture + hs.edit(at="input")), and its shapes are the ones it states."""
    ns: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster on a shared machine
    try:
        exec(
            compile(_section("## Activation patching"), "README.md#activation-patching", "exec"), ns
        )
    finally:
        torch.set_num_threads(threads)
    model, clean, corrupt, metric = ns["model"], ns["clean"], ns["corrupt"], ns["logit_diff"]
    assert ns["resid"].shape == (2, 13) and ns["heads"].shape == (2, 13, 4)
    assert ns["scores"].shape == (2, 4)
    blocks = list(hs.blocks(model))
    with torch.no_grad(), hs.capture(model, blocks, inputs=True) as cap:
        model(clean)
    ref = torch.zeros(2, 13)
    for i, name in enumerate(blocks):
        src = cap.inputs[name].args[0]
        for p in range(13):

            def patch(x, p=p, src=src):
                x = x.clone()
                x[:, p] = src[:, p]
                return x

            with torch.no_grad(), hs.edit(model, {name: patch}, at="input"):
                ref[i, p] = metric(model(corrupt))
    assert torch.allclose(ns["resid"], ref, atol=1e-5)
    assert ref[:, 8:].abs().max() > 1e-3  # the swapped name matters from its position on
    assert [t.get_text() for t in ns["fig"].axes[0].get_xticklabels()][8] == "john"
    assert hs.hooks_on(model) == []
