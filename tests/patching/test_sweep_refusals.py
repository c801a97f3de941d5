"""A sweep refuses what would give noise or another experiment than the one asked for, in one line
naming the argument: a forward that is random by any means (torch's global generators, a
generator of its own), with the fix that applies; an ``arg=`` without ``at="input"``; arguments of
a wrong type or range (never read as another value); a selection spanning an encoder's and a
decoder's stack."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.lm import tiny_gpt2


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.5))  # training=True whatever the mode


class _OwnGenerator(nn.Module):
    """A stochastic forward that draws from its own generator, not torch's global one."""

    def __init__(self, reseed: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.g = torch.Generator().manual_seed(0)
        self.reseed = reseed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reseed:
            self.g.manual_seed(0)
        h = self.a(x)
        return self.b(h * (torch.rand(h.shape, generator=self.g) > 0.5))


def _metric(out: torch.Tensor) -> torch.Tensor:
    return out[:, 0].sum()


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_random_forward_of_an_eval_model_names_the_functional_cause_not_eval(fn):
    """An eval() model whose forward calls F.dropout(x, 0.5): the error names the functional
    cause and its fix, not "call model.eval() first" (already applied, does nothing)."""
    torch.manual_seed(0)
    net = _FunctionalDropout().eval()
    clean, corrupt = torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(hs.PatchingError) as err:
        getattr(hs, fn)(net, clean, corrupt, _metric, ["a"], over=())
    msg = str(err.value)
    assert "call model.eval() first" not in msg and "\n" not in msg
    assert msg.startswith(
        f"{fn}: the model draws random numbers in the forward of '<root>' (_FunctionalDropout)"
    )
    assert "no module is in training mode" in msg
    assert "F.dropout(x, p, training=self.training)" in msg
    # in training mode the fix is eval(), and it is named with the modules
    with pytest.raises(
        hs.PatchingError, match=r"model\.eval\(\) first \(modules in training mode: '<root>', 'a'"
    ):
        getattr(hs, fn)(net.train(), clean, corrupt, _metric, ["a"], over=())


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_a_forward_that_draws_from_its_own_generator_is_refused(fn):
    """A forward sampling with its own torch.Generator (invisible to the global generators):
    two identical sweeps returned different values; the two clean runs are compared and the
    sweep refuses, naming the first activation that differs and the cause."""
    torch.manual_seed(0)
    net = _OwnGenerator().eval()
    clean, corrupt = torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(hs.PatchingError) as err:
        getattr(hs, fn)(net, clean, corrupt, _metric, ["b"], over=(), at="input")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"{fn}: two forwards of the model on the same clean inputs gave different values "
        "(the activation of 'b'), though it draws nothing from torch's global generators"
    )
    assert "a torch.Generator of its own" in msg


def test_a_forward_with_a_reseeded_generator_of_its_own_is_swept_exactly():
    """A generator reseeded at each forward gives the same mask every run: the sweep runs and
    equals the metric of a run patched by hand."""
    torch.manual_seed(0)
    net = _OwnGenerator(reseed=True).eval()
    clean, corrupt = torch.randn(1, 8), torch.randn(1, 8)
    got = hs.patch_sweep(net, clean, corrupt, _metric, ["a"], over=())
    keep = {}
    h = net.a.register_forward_hook(lambda m, a, o: keep.__setitem__("a", o))
    with torch.no_grad():
        net(clean)
    h.remove()
    h = net.a.register_forward_hook(lambda m, a, o: keep["a"])
    with torch.no_grad():
        ref = _metric(net(corrupt))
    h.remove()
    assert ref != _metric(net(corrupt).detach())  # the patch changes the metric
    assert got.shape == (1,) and torch.equal(got[0], ref)


def _lm_case():
    model = tiny_gpt2(n_layer=2).eval()
    clean, corrupt = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[3, 4, 7, 6]])
    return model, clean, corrupt, lambda out: out.logits[:, -1, 5].sum()


@pytest.mark.parametrize("fn", ["patch_sweep", "attribution_patch"])
def test_arg_without_at_input_is_refused(fn):
    """arg=5 (an input of the block) without at="input" patched the block's output silently;
    refused as hs.edit refuses it."""
    model, clean, corrupt, metric = _lm_case()
    with pytest.raises(hs.PatchingError) as err:
        getattr(hs, fn)(model, clean, corrupt, metric, ["transformer.h.1"], arg=5)
    assert str(err.value) == (
        f"{fn}: arg= selects an input; use it with at='input' (got arg=5 with at='output')"
    )
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("arg", [1.0, True, 0.0, -1, b"x", None.__class__])
def test_arg_that_is_not_an_index_or_a_name_is_refused_not_read_as_another_input(arg):
    """arg=1.0 patched input 0 silently (its values equal arg=0's, where arg=1 raises), and
    arg=True was read as 1; only an int >= 0 (not a bool) or a str is an input."""
    model, clean, corrupt, metric = _lm_case()
    for fn in ("patch_sweep", "attribution_patch"):
        with pytest.raises(hs.PatchingError, match=rf"^{fn}: arg must be a positional index") as e:
            getattr(hs, fn)(model, clean, corrupt, metric, ["transformer.h.1"], at="input", arg=arg)
        assert "\n" not in str(e.value)


def test_an_int_or_str_arg_still_selects_that_input():
    """arg=0 and arg="hidden_states" name the same input of a GPT-2 block: equal sweeps, which
    differ from the output's."""
    model, clean, corrupt, metric = _lm_case()
    a = hs.patch_sweep(model, clean, corrupt, metric, ["transformer.h.1"], at="input", arg=0)
    b = hs.patch_sweep(
        model, clean, corrupt, metric, ["transformer.h.1"], at="input", arg="hidden_states"
    )
    out = hs.patch_sweep(model, clean, corrupt, metric, ["transformer.h.1"])
    assert torch.equal(a, b) and not torch.allclose(a, out)


_BAD = [
    # (function, keyword, value, message start after "<fn>: " where the function names itself)
    ("patch_sweep", "rows", "2", "rows must be an int >= 1 (rows per pass) or None, got str '2'"),
    ("patch_sweep", "rows", 2.5, "rows must be an int >= 1 (rows per pass) or None, got float 2.5"),
    (
        "patch_sweep",
        "rows",
        True,
        "rows must be an int >= 1 (rows per pass) or None, got bool True",
    ),
    ("patch_sweep", "rows", -3, "rows must be >= 1 (rows per pass), got -3"),
    ("patch_sweep", "max_bytes", math.nan, "max_bytes must be an int >= 1"),
    ("patch_sweep", "max_bytes", 0, "max_bytes must be >= 1"),
    ("patch_sweep", "max_bytes", "1GB", "max_bytes must be an int >= 1"),
    (
        "attribution_patch",
        "top_k",
        1.5,
        "top_k must be an int >= 1 (the sites to patch exactly) or None, got float 1.5",
    ),
    ("attribution_patch", "top_k", math.nan, "top_k must be an int >= 1"),
    ("attribution_patch", "top_k", -1, "top_k must be >= 1"),
    ("patch_sweep", "reverse", "yes", "patch_sweep: reverse must be True or False, got str 'yes'"),
    ("attribution_patch", "reverse", None, "attribution_patch: reverse must be True or False"),
    ("patch_sweep", "at", None, "patch_sweep: at must be 'output' or 'input', got None"),
    ("attribution_patch", "at", ["input"], "attribution_patch: at must be 'output' or 'input'"),
    (
        "patch_sweep",
        "metric",
        "logits",
        "patch_sweep: metric must be a function metric(output) -> scalar, got str",
    ),
    ("attribution_patch", "metric", None, "attribution_patch: metric must be a function"),
    (
        "patch_sweep",
        "head_proj",
        3,
        "patch_sweep: head_proj must be the name of the output projection",
    ),
    ("patch_sweep", "over", 5, "over=5 is not a sweep this supports"),
    ("attribution_patch", "over", None, "over=None is not a sweep this supports"),
    (
        "patch_sweep",
        "over",
        ("position", "position"),
        "over=('position', 'position') is not a sweep",
    ),
    (
        "patch_sweep",
        "n_heads",
        2.0,
        "n_heads must be a positive number of attention heads, got 2.0",
    ),
    (
        "attribution_patch",
        "n_heads",
        0,
        "n_heads must be a positive number of attention heads, got 0",
    ),
]


@pytest.mark.parametrize(
    ("fn", "key", "value", "start"), _BAD, ids=[f"{b[0]}-{b[1]}-{b[2]!r}" for b in _BAD]
)
def test_an_argument_of_a_wrong_type_or_range_is_one_line_naming_it(fn, key, value, start):
    """rows="2" gave a raw "'<' not supported", rows=2.5 was accepted, top_k=1.5 a raw topk
    error; each argument of a wrong type or range is one line that names it."""
    model, clean, corrupt, metric = _lm_case()
    kwargs = {
        "at": "output",
        "over": ("head",) if key in ("n_heads", "head_proj") else ("position",),
    }
    kwargs[key] = value
    args = [model, clean, corrupt, metric, ["transformer.h.1.attn"]]
    if key == "metric":
        args[3] = value
        del kwargs["metric"]
    with pytest.raises(hs.HookscopeError) as err:  # HeadSplitError for n_heads=
        getattr(hs, fn)(*args, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and start in msg, msg


def test_a_selection_spanning_an_encoder_and_a_decoder_suggests_one_stack_each():
    """hs.blocks(t5) gives both stacks, whose sequences differ in length: the refusal names a
    layer of each and suggests hs.blocks(model, within=...) with each stack's name."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=4
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).eval()
    clean = {
        "input_ids": torch.tensor([[3, 4, 5, 6, 7, 1]]),
        "decoder_input_ids": torch.tensor([[0, 3, 4]]),
    }
    corrupt = {**clean, "input_ids": torch.tensor([[3, 4, 9, 6, 7, 1]])}
    both = hs.blocks(model)
    for fn in (hs.patch_sweep, hs.attribution_patch):
        with pytest.raises(hs.PatchingError) as err:
            fn(model, clean, corrupt, lambda o: o.logits[:, -1, 5].sum(), both)
        msg = str(err.value)
        assert "(3,) from 'decoder.block.0', (6,) from 'encoder.block.0'" in msg
        assert msg.endswith(
            "(select one stack at a time: hs.blocks(model, within='encoder') or "
            "hs.blocks(model, within='decoder'))"
        )
        # the suggestion works: each stack alone sweeps
        for stack, length in (("encoder", 6), ("decoder", 3)):
            got = fn(
                model,
                clean,
                corrupt,
                lambda o: o.logits[:, -1, 5].sum(),
                hs.blocks(model, within=stack),
            )
            assert got.shape == (1, length)


def test_plot_patching_refuses_what_it_cannot_draw_and_draws_nan_blank():
    """A list for values, an empty result, a str for layers or tokens: one line naming the
    argument (a str was split into characters); NaN (the sites top_k did not patch) leaves the
    colour range to the finite values."""
    pytest.importorskip("matplotlib")
    v = torch.tensor([[0.5, float("nan")], [-2.0, 1.0]])
    fig = hs.plot_patching(v, ["h.0", "h.1"], tokens=["a", "b"])
    assert fig.axes[0].images[0].get_clim() == (-2.0, 2.0)
    cases = [
        (
            ([[0.5, 1.0]],),
            {},
            "plot_patching: values must be the tensor patch_sweep or attribution_patch returned, got list",
        ),
        (
            (torch.zeros(0, 3),),
            {},
            "plot_patching: values is empty (shape (0, 3)): nothing to draw",
        ),
        (
            (v, "h.0"),
            {},
            "plot_patching: layers must be a list of layer names, got the str 'h.0'; e.g. ['h.0'] or list(hs.blocks(model))",
        ),
        (
            (v, ["h.0", "h.1"]),
            {"tokens": "ab"},
            "plot_patching: tokens must be a list of strings or a tensor of token ids, got str 'ab'",
        ),
        ((v, ["h.0"]), {}, "plot_patching: 1 layer names for a result of 2 layers"),
    ]
    for args, kwargs, msg in cases:
        with pytest.raises(hs.PatchingError) as err:
            hs.plot_patching(*args, **kwargs)
        assert str(err.value) == msg
