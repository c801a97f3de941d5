"""hs.compare with a compiled B in the forms users write: code Dynamo compiled before hs.compare
added its hooks (a compiled model called once before, a forward compiled as a function) skips
the hooks; refused naming the modules and the fix, never a report without their rows."""

from __future__ import annotations

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


def test_a_compiled_b_called_before_is_refused_naming_the_modules_and_the_fix():
    """Called once before hs.compare, the compiled loop ran without the hooks added later: every
    module of B was unmatched and the planted fault in blocks.1.fc1 went unnamed (culprit None).
    Refused; after torch._dynamo.reset(), as the message says, the fault is named."""
    a, b = Net(), torch.compile(_faulty(), backend="aot_eager")
    b(X)
    with pytest.raises(hs.CompareError, match="did not run in its compiled code") as info:
        hs.compare(a, b, X, loss_fn=loss)
    assert "'blocks.0'" in str(info.value) and "torch._dynamo.reset()" in str(info.value)
    torch._dynamo.reset()
    assert hs.compare(a, b, X, loss_fn=loss).culprit == "blocks.1.fc1"


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
