"""The README's quick start runs as written and does what its comments say."""

from __future__ import annotations

import pathlib

import torch

import hookscope as hs

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


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
    # the clip acts on the next backward (the handle stays until removed)
    model.zero_grad()
    model(x).sum().backward()
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) <= 0.01
    ns["handle"].remove()
    assert hs.hooks_on(model) == []


DOC_PAGES = [
    README,
    *sorted((README.parent / "docs" / "guide").glob("*.md")),
    README.parent / "docs" / "index.md",
]


def test_every_python_block_of_the_readme_and_the_guides_is_valid_python():
    # the guides hold what used to be the README's reference sections; the quick start above
    # runs, the rest must at least be Python a user can paste
    import ast
    import re

    blocks = 0
    for page in DOC_PAGES:
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", page.read_text(), re.S)):
            ast.parse(m.group(1), filename=f"{page.name}#block{i}")
            blocks += 1
    assert blocks >= 12


def test_readme_links_resolve():
    import re

    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (README.parent / target).exists(), target


def _section(title: str, page: pathlib.Path = README) -> str:
    text = page.read_text()
    start = text.index("```python", text.index(title)) + len("```python")
    return text[start : text.index("```", start)]


def test_generation_guide_runs_and_its_comments_hold():
    import sys

    sys.path.insert(0, str(README.parent / "tests"))
    from helpers.lm import tiny_gpt2, word_tokenizer

    model, tok = tiny_gpt2(n_layer=6), word_tokenizer("left")
    ns: dict = {"model": model, "tok": tok}
    page = README.parent / "docs" / "guide" / "generation.md"
    code = _section("# Language models: generation, steering vectors, steering", page)
    exec(compile(code, "docs/guide/generation.md", "exec"), ns)
    seq, out, steered = ns["seq"], ns["out"], ns["steered"]
    assert seq.values.shape == (2, 13, 64) and seq.mask.sum(1).tolist() == [13, 9]
    # row 0 (no padding) equals one forward over its final sequence
    with hs.capture(model, "transformer.h.5") as ref:
        model(out[:1, :-1])
    torch.testing.assert_close(seq.values[0], ref["transformer.h.5"][0], atol=1e-5, rtol=0)
    assert seq.tokens[0].tolist() == out[0, :-1].tolist()
    assert list(ns["vec"]) == ["transformer.h.3"] and not torch.equal(out, steered)


PATCHING = README.parent / "docs" / "guide" / "patching.md"


def test_patching_guide_runs_and_equals_a_hand_loop():
    """The IOI-style block runs as written; its residual sweep equals a hand-written loop of one
    forward per site (hs.capture + hs.edit(at="input")), and its shapes are the ones it states."""
    ns: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster on a shared machine
    try:
        exec(
            compile(_section("# Activation patching", PATCHING), "docs/guide/patching.md", "exec"),
            ns,
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


def test_lightning_example_stops_and_the_readme_shows_the_file_spec():
    trainers = (README.parent / "docs" / "guide" / "trainers.md").read_text()
    lightning = trainers[trainers.index("L.Trainer(") :]
    assert "max_epochs=" in lightning[: lightning.index("trainer.fit")]
    text = README.read_text()
    assert "file.py:Name" in text and "hf:path/to/config.json" in text
