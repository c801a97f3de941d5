"""Does a model draw random numbers in its forward? Asked of the run itself, not of module types.

Dropout called as a function (``F.dropout(x, p, self.training)``, attention dropout inside
``scaled_dot_product_attention``), stochastic depth and sampling layers are invisible to a list of
module types. Every one of them draws from a generator: torch's global ones, or one the model
keeps itself (a ``torch.Generator`` held by a module, or passed in the inputs); a forward that
leaves all of those where it found them drew nothing. Products that compare runs (a patched run
against a clean one, two prompts' activations) check this on their first forward and refuse a
model whose values change from run to run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from ._compiled import named_modules

__all__ = [
    "GeneratorStates",
    "RandomDraws",
    "draw_fix",
    "draw_place",
    "drawing_module",
    "generators_of",
    "random_draws",
    "training_modules",
]


class RandomDraws:
    """Set by :func:`random_draws`: ``drew`` is True when the code inside it advanced a global
    generator (the CPU one, or that of any CUDA device already initialised)."""

    __slots__ = ("drew",)

    def __init__(self) -> None:
        self.drew = False


def _generators(roots: tuple[Any, ...]) -> list[torch.Generator]:
    """The generators a model keeps itself: held by any of its modules (``self.gen``, in a list
    or dict attribute), or passed among its inputs."""
    found: dict[int, torch.Generator] = {}

    def walk(obj: Any, depth: int) -> None:
        cls = obj.__class__
        if cls is torch.Generator:  # (not isinstance: its metaclass makes that slow)
            found[id(obj)] = obj
        elif cls in _PLAIN:
            return
        elif depth and cls in (list, tuple):
            for v in obj:
                walk(v, depth - 1)
        elif depth and (cls is dict or isinstance(obj, dict)):
            for v in obj.values():
                walk(v, depth - 1)

    for root in roots:
        if isinstance(root, nn.Module):
            for m in root.modules():
                for k, v in m.__dict__.items():
                    if k not in _MODULE_OWN and v.__class__ not in _PLAIN:
                        walk(v, 2)
        else:
            walk(root, 4)
    return list(found.values())


_PLAIN = frozenset({bool, int, float, str, type(None), torch.Tensor, nn.Parameter})
# what every nn.Module keeps (its parameters, buffers, submodules, hooks): no generator there
_MODULE_OWN = frozenset(nn.Module().__dict__)


def _states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += list(torch.cuda.get_rng_state_all())
    return states + [g.get_state() for g in generators]


def generators_of(*roots: Any) -> list[torch.Generator]:
    """The generators ``roots`` hold (models: any module's attributes; inputs: nested lists,
    tuples and dicts); torch's global ones are always watched besides."""
    return _generators(roots)


class GeneratorStates:
    """The states of torch's global generators and of ``generators``, taken when made;
    :meth:`moved` says whether any has moved since (a draw happened)."""

    __slots__ = ("before", "generators")

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators
        self.before = _states(generators)

    def moved(self) -> bool:
        after = _states(self.generators)
        return len(after) != len(self.before) or any(
            not torch.equal(a, b) for a, b in zip(self.before, after)
        )


@contextmanager
def random_draws(*roots: Any) -> Iterator[RandomDraws]:
    """Note whether the code inside draws random numbers (the generators are not restored: the
    draws happened in a run the caller keeps): from torch's global generators, or from one that
    ``roots`` (models, inputs) hold.

    >>> with random_draws() as d:
    ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5, training=True)
    >>> d.drew
    True
    >>> with random_draws() as d:
    ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5, training=False)
    >>> d.drew
    False
    >>> g = torch.Generator().manual_seed(0)
    >>> with random_draws([g]) as d:
    ...     _ = torch.rand(2, generator=g)
    >>> d.drew
    True
    """
    found = RandomDraws()
    states = GeneratorStates(_generators(roots))
    try:
        yield found
    finally:
        found.drew = states.moved()


def training_modules(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` names of modules in training mode (``""`` is the root), for messages."""
    return [name or "<root>" for name, m in named_modules(model) if m.training][:limit]


def drawing_module(model: nn.Module, run: Callable[[], Any], *roots: Any) -> str | None:
    """Run ``run()`` (a forward of ``model``, on a path that is refusing a model that drew) and
    name the innermost module whose call advanced a generator (torch's global ones, or one that
    ``model`` or ``roots`` hold): ``""`` for the root, ``None`` when no module call drew (the
    draw is outside every call) or ``run`` raised. For a message naming where the draw is.

    >>> class Noisy(nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.dropout(x, 0.5, training=True)
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Tanh(), Noisy())).eval()
    >>> drawing_module(net, lambda: net(torch.ones(1, 2)))
    '1.1'
    """
    from ._scope import HookScope, _Hook  # (the scope module imports this one)

    generators = _generators((model, *roots))
    stack: list[list[torch.Tensor]] = []
    found: list[str] = []

    def pre(_m: nn.Module, _args: Any) -> None:
        stack.append(_states(generators))

    def post(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            before = stack.pop() if stack else None
            if found or before is None:
                return
            after = _states(generators)
            if len(after) != len(before) or any(
                not torch.equal(a, b) for a, b in zip(before, after)
            ):
                found.append(name)  # the first call to end having drawn: the innermost

        return hook

    from ._buffers import state_kept

    scope = HookScope("random")
    named = list(named_modules(model))
    scope.add_forward_many(
        [(m, _Hook(pre, "random", "forward_pre", n, scope.id), n) for n, m in named], pre=True
    )
    scope.add_forward_many(
        [(m, _Hook(post(n), "random", "forward", n, scope.id), n) for n, m in named],
        always_call=True,
    )
    with scope, state_kept(model):  # (running statistics in training mode, counters: as found)
        try:
            with torch.no_grad():
                run()
        except Exception:
            return None
    return found[0] if found else None


def draw_place(model: nn.Module, run: Callable[[], Any], *roots: Any) -> str:
    """Where a refused model draws, for a message: ``" in the forward of 'blocks.1.drop'
    (StochasticDepth)"`` (:func:`drawing_module`), or ``" in its forward"``."""
    where = drawing_module(model, run, *roots)
    if where is None:
        return " in its forward"
    module = dict(named_modules(model)).get(where)
    return f" in the forward of {where or '<root>'!r} ({type(module).__name__})"


def draw_fix(model: nn.Module) -> str:
    """The fix for a model that draws random numbers: ``eval()`` where modules are in training
    mode; else the code draws whatever the mode, and eval() would not help."""
    training = training_modules(model)
    if training:
        return (
            f"call model.eval() first (modules in training mode: {', '.join(map(repr, training))}; "
            "dropout, also inside attention)"
        )
    return (
        "no module is in training mode: that code draws whatever the mode (F.dropout(x, p) "
        "without training=self.training, torch.rand, a sampling layer, stochastic depth), so "
        "model.eval() does not help; make it deterministic in eval mode "
        "(F.dropout(x, p, training=self.training))"
    )
