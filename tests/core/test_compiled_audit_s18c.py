"""Audit (round 18, compiled models): each test failed before its fix, for the reason it names.

References are independent of hookscope: the same weights run eagerly with plain
``register_forward_hook`` hooks written here, or the plain computation.
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import hookscope as hs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Loop(nn.Module):
    """A layer before a loop over a ModuleList, then the loop (Dynamo unrolls it in one graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def _plain(model: nn.Module, names: list[str], x: torch.Tensor, edit=None) -> tuple[dict, Any]:
    """Outputs of ``names`` (and the model's output) from plain hooks on the eager model;
    ``edit``: ``{name: fn}`` replacing those outputs."""
    got: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:

        def hook(mod, args, out, name=name):
            got[name] = out.detach().clone()

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    for name, fn in (edit or {}).items():
        handles.append(model.get_submodule(name).register_forward_hook(lambda m, a, o, f=fn: f(o)))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    return got, out


def _compile(model: nn.Module, form: str) -> nn.Module:
    if form == "wrapper":
        return torch.compile(model, backend="eager")
    model.compile(backend="eager")
    return model


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_hooks_in_a_warm_compiled_loop_run_when_others_fire(form):
    """A warm compiled model (called once without hooks), hooks on a layer before a ModuleList
    loop and on layers inside it: the variant's trace gave up at the hook inside the loop and
    Dynamo ran the model's ``forward`` as a frame of its own, where it reused the code the warm
    call compiled (no hooks). A capture before the loop fired, so no warning came; the edit on
    ``blocks.1`` silently did not act and the capture of ``blocks.2`` was missing."""
    eager = _Loop()
    x = torch.randn(2, 4)
    names = ["", "blocks.2"]  # the model itself, and a layer in the loop
    ref, ref_out = _plain(eager, names, x, edit={"blocks.1": torch.zeros_like})
    cm = _compile(copy.deepcopy(eager), form)
    with torch.no_grad():
        cm(x)  # warm
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad(), hs.capture(cm, names) as cap:
            with hs.edit(cm, {"blocks.1": hs.ops.zero()}):
                out = cm(x)
            assert torch.equal(out, ref_out)  # the edit acted in the call
    assert not [w for w in seen if issubclass(w.category, hs.HookscopeWarning)]
    for name, value in ref.items():
        assert torch.equal(cap[name], value), name


def _step(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(block(x))


class _Helper(nn.Module):
    """Blocks called through a helper function, in a loop with a graph break (a print): the
    compiled code gives up the loop and compiles each call of ``_step`` as a frame of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = _step(b, x)
            print("", end="")
        return self.head(x)


@pytest.mark.parametrize("form", ["wrapper", "in_place"])
def test_hooks_in_a_helper_the_warm_compile_ran_as_a_frame_run(form):
    """A warm compiled model whose loop calls its blocks through a helper function, with a graph
    break in the loop: the warm call compiled ``_step`` as a frame without hooks, and the hooked
    variant reused it (an isolated cache falls back to the default entries of code it runs).
    The hook on ``head`` fired, those on ``blocks.1`` silently did not: no warning, the edit did
    not act, the capture had no call. Now the region runs eagerly with the graph-break
    warning naming the layers, and the values equal the eager model's."""
    eager = _Helper()
    x = torch.randn(2, 4)
    ref, ref_out = _plain(eager, ["head"], x, edit={"blocks.1": torch.zeros_like})
    cm = _compile(copy.deepcopy(eager), form)
    with torch.no_grad():
        cm(x)  # warm
    with (
        pytest.warns(hs.HookscopeWarning, match=r"'blocks.1', 'head'.*graph breaks"),
        torch.no_grad(),
        hs.capture(cm, ["head"]) as cap,
    ):
        with hs.edit(cm, {"blocks.1": hs.ops.zero()}):
            out = cm(x)
        assert torch.equal(out, ref_out)  # the edit acted in the call
    assert torch.equal(cap["head"], ref["head"])


# a helper defined in another source file (as ``from helpers import step`` would give)
_elsewhere: dict[str, Any] = {"torch": torch}
exec(
    compile("def step(block, x):\n    return torch.relu(block(x))\n", "helpers_s18c.py", "exec"),
    _elsewhere,
)
_step_elsewhere = _elsewhere["step"]


class _HelperElsewhere(_Helper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = _step_elsewhere(b, x)
            print("", end="")
        return self.head(x)


def test_hooks_in_a_helper_from_another_file_the_warm_compile_ran_as_a_frame_run():
    """The same with the helper imported from another file (not found by the model's source
    files): its hooks were skipped while ``head``'s fired, silently. Found now by the functions
    the model's code names; the region runs eagerly with the warning, the values are eager's."""
    eager = _HelperElsewhere()
    x = torch.randn(2, 4)
    ref, _ = _plain(eager, ["head", "blocks.1"], x)
    cm = _compile(copy.deepcopy(eager), "wrapper")
    with torch.no_grad():
        cm(x)  # warm
    with (
        pytest.warns(hs.HookscopeWarning, match=r"'blocks.1', 'head'.*graph breaks"),
        torch.no_grad(),
        hs.capture(cm, ["head", "blocks.1"]) as cap,
    ):
        cm(x)
    for name, value in ref.items():
        assert cap.calls(name), name
        assert torch.equal(cap[name], value), name


def test_memory_profile_of_a_compiled_model_does_not_print_unmeasured_zeros():
    """A compiled model's live and peak bytes and FLOPs are not measured (0 in the fields, as
    documented), but the table printed them as measured: 'live at end of forward: 0 B; peak
    forward 0 B' and a FLOPs column of zeros, for a step that created tensors and did
    multiplications (the eager profile: nonzero). Now the text says they were not measured."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    cm = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    cm(x)
    ref = hs.memory_profile(eager, x)
    # the two matmuls alone: 2 * 3 * (4 * 8 + 8 * 2) FLOPs
    assert ref.peak_forward_bytes > 0 and ref.rows[0].flops_total >= 2 * 3 * (4 * 8 + 8 * 2)
    text = hs.memory_profile(cm, x).to_text()
    assert "peak forward 0 B" not in text and "live at end of forward: 0 B" not in text
    assert "not measured in a compiled model" in text
    flops = [line.split()[-1] for line in text.splitlines()[3:7]]
    assert flops == ["n/a"] * 4


class _Defaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)

    def forward(self, x, scale=2.0, *, shift=1.0):
        return self.a(x) * scale + shift


class _Super(_Defaults):
    def forward(self, x, scale=3.0, *, shift=0.5, **kw):
        return super().forward(x, scale, shift=shift) + 1


@pytest.mark.parametrize("cls", [_Defaults, _Super])
def test_the_variant_copy_of_forward_keeps_defaults_and_super(cls):
    """The hooked variant compiles a copy of the root's forward (the fix above): its positional
    and keyword-only defaults and zero-argument super() behave as the original's."""
    eager = cls()
    cm = torch.compile(copy.deepcopy(eager), backend="eager")
    x = torch.randn(2, 4)
    cm(x)
    ref, _ = _plain(eager, ["a"], x)
    with warnings.catch_warnings(), torch.no_grad(), hs.capture(cm, ["a"]) as cap:
        warnings.simplefilter("error", hs.HookscopeWarning)
        got = [cm(x), cm(x, 5.0), cm(x, shift=-2.0)]
    with torch.no_grad():
        want = [eager(x), eager(x, 5.0), eager(x, shift=-2.0)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert [torch.equal(c.output, ref["a"]) for c in cap.calls("a")] == [True] * 3


# a helper module from another file, used as attributes: helpers.step(...), an object's method
_helpers = types.ModuleType("helpers_mod_s18c")
_helpers.__dict__["torch"] = torch
exec(
    compile(
        "def step(block, x):\n    return torch.relu(block(x))\n\n"
        "class Router:\n    def run(self, block, x):\n        return torch.relu(block(x))\n",
        "helpers_mod_s18c.py",
        "exec",
    ),
    _helpers.__dict__,
)


class _HelperKinds(_Helper):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.router, self.fn = kind, _helpers.Router(), _helpers.step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.kind == "module_attr":
                x = _helpers.step(b, x)
            elif self.kind == "object_method":
                x = self.router.run(b, x)
            else:
                x = self.fn(b, x)
            print("", end="")
        return self.head(x)


@pytest.mark.parametrize("kind", ["module_attr", "object_method", "function_attr"])
def test_hooks_in_helpers_reached_through_attributes_the_warm_compile_ran_as_frames_run(kind):
    """Helpers reached through an attribute (``helpers.step(b, x)``, ``self.router.run(b, x)``,
    ``self.fn(b, x)``), compiled as frames by the warm call: ``blocks.1``'s hooks were skipped
    while ``head``'s fired, silently. Now the region runs eagerly with the warning."""
    eager = _HelperKinds(kind)
    x = torch.randn(2, 4)
    ref, _ = _plain(eager, ["head", "blocks.1"], x)
    cm = _compile(copy.deepcopy(eager), "wrapper")
    with torch.no_grad():
        cm(x)  # warm
    with (
        pytest.warns(hs.HookscopeWarning, match=r"'blocks.1', 'head'.*graph breaks"),
        torch.no_grad(),
        hs.capture(cm, ["head", "blocks.1"]) as cap,
    ):
        cm(x)
    for name, value in ref.items():
        assert cap.calls(name), name
        assert torch.equal(cap[name], value), name


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def test_a_compiled_loss_in_the_models_file_keeps_the_model_compiled():
    """Code compiled elsewhere (a loss compiled in the file that defines the model) is never run
    by the hooked variant: it does not make the model run eagerly (no warning), and the values
    equal eager's."""
    eager = _Loop()
    x = torch.randn(2, 4)
    ref, _ = _plain(eager, ["blocks.1"], x)
    cm = _compile(copy.deepcopy(eager), "wrapper")
    closs = torch.compile(_loss, backend="eager")
    with torch.no_grad():
        closs(cm(x))  # warm, both
    with warnings.catch_warnings(), torch.no_grad(), hs.capture(cm, ["blocks.1"]) as cap:
        warnings.simplefilter("error", hs.HookscopeWarning)
        closs(cm(x))
    assert torch.equal(cap["blocks.1"], ref["blocks.1"])
