"""Small helpers used by several test packages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn as nn


def files_of(path: Path) -> dict[str, bytes]:
    """Every file directly in ``path``, by name, with its bytes (to compare two output folders)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@contextmanager
def one_thread() -> Iterator[None]:
    """This process at one intra-op thread: faster for tiny models on a shared machine, and what
    the ranks of :func:`helpers.dist.launch` use (a CPU kernel's last bits depend on the thread
    count, so byte-for-byte comparisons with the ranks need it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mlp6() -> nn.Sequential:
    """A seeded 6 -> 16 -> 16 -> 3 MLP (Tanh, ReLU): the trainers' and the monitor's small net."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


# bn2's output gets ``out += identity`` later in its block: a site an in-place op changes
RESNET34_RESIDUAL_SITES = ["layer2.1.bn2", "layer3.3.conv2"]


def resnet34_with_fx_features(
    layers: list[str] | None = None,
) -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """A seeded random-weight torchvision resnet34 (eval), a seeded 1x3x64x64 input, and the
    independent reference: torchvision's FX features at ``layers`` (default: the residual sites)."""
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor

    layers = list(RESNET34_RESIDUAL_SITES if layers is None else layers)
    torch.manual_seed(0)
    model = torchvision.models.resnet34(weights=None).eval()
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = create_feature_extractor(model, return_nodes=layers)(x)
    return model, x, ref


@pytest.fixture(autouse=True)
def tiny_models_on_one_thread() -> Iterator[None]:
    """An autouse fixture for test files of tiny models (import it into the file): one
    intra-op thread is faster than two spinning on a shared machine."""
    with one_thread():
        yield


def plain_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference for a step under hookscope: ``model(x)`` and the parameter gradients of
    ``out.pow(2).sum()`` without any hook; ``.grad`` left cleared."""
    out = model(x)
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


class KeepsItsInput(nn.Module):
    """A residual kept from before an in-place ReLU: the ReLU changes it too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        skip = h
        y = self.act(h)
        return self.out(y * 2 + skip * 3)


class Counting(nn.Module):
    """A layer with Python state its forward changes, as a model of one's own may have: a call
    counter that scales the output (added as an instance attribute on the first call), a list
    it appends to and a tensor attribute (not a buffer) it adds to in place. A product that runs
    the model again must start each run from the state the first one did and leave it as found."""

    calls = 0

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.seen: list[float] = []
        self.total = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(float(x.detach().norm()))
        self.total += 1
        return self.lin(x) * self.calls

    def state(self) -> tuple:
        return ("calls" in self.__dict__, self.calls, list(self.seen), float(self.total))


class Box:
    """An object of the user's own holding a tensor: what :class:`Boxing` returns (its tensor is
    in no tuple, list, dict or dataclass)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class Boxing(nn.Module):
    """A linear layer returning its output inside a :class:`Box`."""

    def __init__(self, n_in: int = 4, n_out: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> Box:
        return Box(self.lin(x))
