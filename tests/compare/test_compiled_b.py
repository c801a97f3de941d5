"""hs.compare with a compiled B in the forms users write: code Dynamo compiled before hs.compare
added its hooks (a compiled model called once before, a forward compiled as a function) skips
the hooks; refused naming the modules and the fix, never a report without their rows."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """Blocks called in a loop over a ModuleList, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


X = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))


def loss(o: torch.Tensor) -> torch.Tensor:
    return o.pow(2).mean()


def _faulty() -> Net:
    b = Net()
    with torch.no_grad():
        b.blocks[1].fc1.bias.add_(0.2)
    return b


def test_a_compiled_b_called_before_names_the_fault():
    """Called once before hs.compare, the compiled loop had run without the hooks added later:
    every module of B was unmatched and the planted fault in blocks.1.fc1 went unnamed (then
    refused). The hooked variant never reuses that code now: the fault is named, as for a B
    compiled fresh, with the same rows."""
    a, b = Net(), torch.compile(_faulty(), backend="aot_eager")
    b(X)
    warm = hs.compare(a, b, X, loss_fn=loss)
    assert warm.culprit == "blocks.1.fc1"
    torch._dynamo.reset()
    cold = hs.compare(a, torch.compile(_faulty(), backend="aot_eager"), X, loss_fn=loss)
    assert [r.name for r in warm.rows] == [r.name for r in cold.rows]


def test_a_forward_compiled_as_a_function_is_refused_naming_the_fix():
    """b.forward = torch.compile(b.forward): its submodules' hooks never ran (even on a first
    call), and the fault was missed with a warning that the models looked different. Refused
    when the hooks are placed (by every product: a capture too), none left behind."""
    a, b = Net(), _faulty()
    b.forward = torch.compile(b.forward, backend="aot_eager")  # type: ignore[method-assign]
    with pytest.raises(hs.UnsupportedModelError, match=r"compiled as a function") as info:
        hs.compare(a, b, X, loss_fn=loss)
    assert "torch.compile(model) or model.compile()" in str(info.value)
    assert hs.hooks_on(b) == []
    with pytest.raises(hs.UnsupportedModelError, match="'blocks.1.fc1' is called by '<root>'"):
        hs.capture(b, "blocks.1.fc1")
    b2 = _faulty()
    assert hs.compare(a, torch.compile(b2, backend="aot_eager"), X, loss_fn=loss).culprit == (
        "blocks.1.fc1"
    )


def test_a_module_that_does_not_run_in_b_is_listed_not_refused():
    """The check runs B eagerly: a module B really does not call (another branch) stays in
    unmatched, as without compile."""

    class Skips(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[0](x))

    b = Skips()
    b.load_state_dict(Net().state_dict())
    r = hs.compare(Net(), torch.compile(b, backend="aot_eager"), X, loss_fn=loss)
    assert {"a: blocks.1#0", "a: blocks.1.fc1#0"} <= set(r.unmatched)


class Mlp(nn.Module):
    """A change only inside the compiled program, in the module's own code before it calls a
    child: B's eager run of the module hands its child another input than the compiled run did."""

    def __init__(self, fault: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fault = nn.Linear(16, 32), nn.Linear(32, 16), fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.fault and torch.compiler.is_compiling():
            h = h * 1.02
        return self.fc2(h)


class Scaled(torch.autograd.Function):
    """Twice its input; with ``fault``, its backward is off by 5% only inside the compiled
    program."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fault: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.fault = fault
        return x * 2.0

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        off = 1.05 if ctx.fault and torch.compiler.is_compiling() else 1.0
        return g * 2.0 * off, None


class Act(nn.Module):
    def __init__(self, fault: bool = False) -> None:
        super().__init__()
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scaled.apply(x, self.fault)


class Outer(nn.Module):
    def __init__(self, fault: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp, self.act, self.head = Mlp(fault), Act(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.mlp(x)))


def test_a_compiled_only_change_before_a_child_s_call_is_named_as_compiled():
    """compile_error compared only the module's output, which its eagerly replayed child (given
    the compiled run's child output) masked: culprit None. It covers what the module hands its
    children too."""
    r = hs.compare(Outer(), torch.compile(Outer(fault=True), backend="aot_eager"), X, loss_fn=loss)
    assert r.culprit == "mlp" and r.row("mlp").flagged == "compiled"
    assert r.row("mlp").compile_error == pytest.approx(0.02 / 1.02, rel=1e-3)
    assert r.row("mlp").local_error == 0.0  # B's module run eagerly is right
    clean = hs.compare(Outer(), torch.compile(Outer(), backend="aot_eager"), X, loss_fn=loss)
    assert clean.culprit is None and max(x.compile_error for x in clean.rows) <= 5e-7


def test_a_backward_that_differs_only_when_compiled_is_named():
    """A module whose compiled backward is off (its forward right): the compiled run's gradients
    differ by 5% below it and nothing was named. B's module is now also run backward eagerly on
    the compiled run's values and output gradient, against the compiled input gradient."""
    a = Outer()
    b = Outer()
    b.act = Act(fault=True)
    r = hs.compare(a, torch.compile(b, backend="aot_eager"), X, loss_fn=loss)
    assert r.culprit == "act" and r.row("act").flagged == "compiled"
    assert r.row("act").compile_error == pytest.approx(0.05 / 1.05, rel=1e-3)
    assert "compiled backward" in r.row("act").note
    assert r.row("act").local_error == 0.0 and r.row("act").local_grad_error == 0.0


class FaultyBlock(Block):
    """Off by 1% only inside the compiled program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        if torch.compiler.is_compiling():
            h = h * 1.01
        return x + h


def _with_faulty_block() -> Net:
    b = Net()
    bad = FaultyBlock()
    bad.load_state_dict(b.blocks[1].state_dict())
    b.blocks[1] = bad
    return b


@pytest.mark.parametrize("form", ["in_place", "fullgraph"])
def test_a_compiled_only_fault_in_a_block_compiled_alone_is_named_as_compiled(form):
    """One block compiled: in place (block.compile()), B's replays ran its compiled code, so the
    fault read as the block's own forward fault with compile_error 0 (and Dynamo traced the
    replay's stubs); with fullgraph=True, hooks cannot run inside, the block ran eagerly and
    the fault was not seen at all (errors 0, no culprit). Replays now run eagerly; a fullgraph
    region's compiled code is run as a whole on its recorded inputs."""
    a, b = Net(), _with_faulty_block()
    if form == "in_place":
        b.blocks[1].compile(backend="aot_eager")
    else:
        b.blocks[1] = torch.compile(b.blocks[1], backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hs.HookscopeWarning)  # (fullgraph: runs eagerly)
        r = hs.compare(a, b, X)
    row = r.row("blocks.1")
    assert r.culprit == "blocks.1" and row.flagged == "compiled"
    assert row.local_error == 0.0 and row.compile_error > 1e-3
    clean = Net()
    clean.blocks[1] = torch.compile(
        clean.blocks[1], backend="aot_eager", fullgraph=form == "fullgraph"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hs.HookscopeWarning)
        r = hs.compare(a, clean, X)
    assert r.culprit is None and not any("replay failed" in x.note for x in r.rows)


def test_a_fault_free_compiled_residual_block_with_in_place_ops_names_nothing():
    """torchvision's BasicBlock (in-place ReLU, `out += identity`) compiled, with a backward:
    the compiled run's recorded input gradients around in-place ops are not the call's own, and
    comparing them with the eager replay's named fault-free blocks 'compiled' (60%); the
    compiled backward is checked on leaf calls that change nothing in place only."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    a = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        torchvision.models.resnet.BasicBlock(8, 8),
        torchvision.models.resnet.BasicBlock(8, 8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    b = torch.compile(copy.deepcopy(a), backend="aot_eager")
    r = hs.compare(a, b, x, loss_fn=lambda o: o.pow(2).mean())
    assert r.culprit is None and not any(row.flagged for row in r.rows)


def test_a_compiled_b_whose_backward_fails_on_an_in_place_module_names_it_and_the_fix():
    """An aot_eager B with ``nn.SiLU(inplace=True)`` runs plainly, but its backward fails under
    the record's hooks on a value changed in place (PyTorch's error names no module): refused
    naming the module that works in place and the fix, which then compares exactly."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.SiLU(inplace=True), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    torch._dynamo.reset()
    b = torch.compile(copy.deepcopy(a), backend="aot_eager")
    loss(b(x)).backward()  # (fine without hooks)
    b.zero_grad(set_to_none=True)
    with pytest.raises(hs.CompareError, match=r"model 'b' is compiled.*in place: '1'; set"):
        hs.compare(a, b, x, loss_fn=loss)
    assert not hs.hooks_on(b)
    torch._dynamo.reset()
    fixed = copy.deepcopy(a)
    fixed[1].inplace = False
    report = hs.compare(a, torch.compile(fixed, backend="aot_eager"), x, loss_fn=loss)
    assert report.culprit is None and all(r.local_error == 0.0 for r in report.rows)
    torch._dynamo.reset()


def test_a_record_of_such_a_model_is_refused_the_same_way_and_leaves_nothing(tmp_path):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.SiLU(inplace=True), nn.Linear(8, 4))
    torch._dynamo.reset()
    b = torch.compile(a, backend="aot_eager")
    refused = pytest.raises(
        hs.CompareError, match=r"^hs.record: model 'Sequential' is compiled.*'1'"
    )
    with refused, hs.record(b, tmp_path / "r"):
        b(torch.randn(3, 8)).pow(2).sum().backward()
    assert list((tmp_path / "r").iterdir()) == [] and not hs.hooks_on(b)
    torch._dynamo.reset()


def _fusing_backend(gm, example_inputs):
    """A compiler with a bug only where one graph holds a linear and a tanh together (fused):
    its output scaled by 1.01 there. Compare's hooks break the graph at every module, so its
    recorded run never has such a graph; the model run as compiled does."""
    ops = [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    fused = any("linear" in t for t in ops) and any("tanh" in t for t in ops)

    def run(*args):
        out = gm(*args)
        if not fused:
            return out
        return type(out)(o * 1.01 if isinstance(o, torch.Tensor) else o for o in out)

    return run


@pytest.mark.parametrize("side", ["b", "a"])
def test_a_difference_made_only_across_module_boundaries_is_said(side):
    """A compiled model whose difference is made only where compilation fuses code across
    modules (here a compiler bug on a graph holding a Linear and its Tanh) compared with every
    error 0, the same loss and no word: the recorded run's hooks break the graph at each module,
    so the fused code never ran. The model now runs once more as compiled without hooks; its
    output against the recorded one (the relative error by hand) is said in a warning and a
    note naming the side and the fix. A fault-free compiled copy says nothing."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(copy.deepcopy(eager), backend=_fusing_backend)
    with torch.no_grad():
        ref, got = eager(x).double(), compiled(x).double()
    err = float((got - ref).norm() / ref.norm())
    assert err > 1e-3  # the compiled model does differ
    a, b = (eager, compiled) if side == "b" else (compiled, eager)
    with pytest.warns(hs.HookscopeWarning, match=rf"{side}: the compiled model without hooks"):
        report = hs.compare(a, b, x, loss_fn=lambda o: o.pow(2).sum())
    assert all(r.error == 0.0 for r in report.rows)  # the recorded runs: unfused, equal
    note = next(n for n in report.notes if "without hooks" in n)
    assert f"relative error {err:.3g}" in note and "layers=" in note
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = hs.compare(eager, torch.compile(copy.deepcopy(eager), backend="aot_eager"), x)
    assert not any("without hooks" in n for n in clean.notes)
