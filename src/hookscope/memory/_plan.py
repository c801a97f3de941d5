"""``MemoryProfile.plan``: which modules to checkpoint to fit a budget, at the least recompute."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core._errors import HookscopeError
from ._frontier import frontier

if TYPE_CHECKING:
    from ._profile import MemoryProfile

__all__ = ["CheckpointPlan", "PlanError", "make_plan", "saved_after"]


class PlanError(HookscopeError):
    """No set of modules to checkpoint fits the budget (the message gives the lowest reachable)."""


@dataclass
class CheckpointPlan:
    """What :meth:`MemoryProfile.plan` advises: modules to wrap in non-reentrant checkpointing.

    Attributes:
        modules: module names to checkpoint (none inside another), in model order.
        budget_bytes: the budget asked for.
        saved_bytes_before: saved bytes of the step without checkpointing.
        predicted_saved_bytes: saved bytes predicted with these modules checkpointed.
        predicted_drop: ``saved_bytes_before - predicted_saved_bytes``. Checkpointing a module
            frees only what nobody outside it keeps: its output saved by the next layer stays, and
            checkpointing keeps the module's tensor inputs (keyword ones included).
        recompute_flops: forward FLOPs run again in backward.
        drops: per module, the bytes checkpointing it alone would free.
        exact: whether the plan is the least-FLOPs one for sure (False when the search had to
            thin its frontiers: a very large model).
        excluded: modules never considered, with the reason (see
            :attr:`MemoryProfile.excluded`: checkpointing them would change the gradients).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> tanhs = nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Tanh())
        >>> net = nn.Sequential(nn.Linear(4, 8), tanhs, nn.Linear(8, 1))
        >>> prof = hs.memory_profile(net, torch.randn(2, 4))
        >>> prof["1"].saved_bytes_total, prof.plan(160).predicted_drop
        (192, 64)
        >>> prof.plan(160).modules  # the middle Tanh: its output is saved by it alone
        ['1.1']
    """

    modules: list[str]
    budget_bytes: int
    saved_bytes_before: int
    predicted_saved_bytes: int
    recompute_flops: int
    drops: dict[str, int] = field(default_factory=dict)
    exact: bool = True
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def predicted_drop(self) -> int:
        return self.saved_bytes_before - self.predicted_saved_bytes

    def __str__(self) -> str:
        from ..core._errors import some_names

        text = (
            f"checkpoint {len(self.modules)} module(s) ({some_names(self.modules, 6)}): saved "
            f"{self.saved_bytes_before:,} -> {self.predicted_saved_bytes:,} bytes (budget "
            f"{self.budget_bytes:,}), recompute {self.recompute_flops:,} FLOPs"
        )
        if self.excluded:
            text += "\n" + _excluded_text(self.excluded)
        return text


def _excluded_text(excluded: dict[str, str], most: int = 6) -> str:
    lines = [
        f"  never checkpointed: {name!r}: {why}" for name, why in list(excluded.items())[:most]
    ]
    if len(excluded) > most:
        lines.append(f"  ... and {len(excluded) - most} more (plan.excluded)")
    return "\n".join(lines)


def saved_after(profile: MemoryProfile, chosen: Iterable[str]) -> int:
    """Saved bytes predicted with ``chosen`` modules under non-reentrant checkpointing.

    What is saved outside every chosen module stays; what is saved inside one is dropped (the
    checkpoint's own hooks take it); each call of a chosen module keeps its tensor inputs
    (keyword ones included). Unique storages are counted once.
    """
    chosen = set(chosen)
    kept: dict[tuple[Any, int], int] = {}
    for e in profile._events:
        if e.param or chosen.intersection(e.stack):
            continue
        kept[e.key] = e.nbytes
    for call in profile._calls:
        if call.module in chosen and not chosen.intersection(call.stack[:-1]):
            for key, n in call.inputs:
                kept[key] = n
    return sum(kept.values())


def _budget(budget: Any) -> int:
    """``budget_bytes`` as an int: a number of bytes, whole and not negative."""
    if isinstance(budget, float) and budget.is_integer():
        budget = int(budget)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(
            f"plan(): budget_bytes must be a number of bytes (an int such as 4_000_000), got "
            f"{type(budget).__name__} {budget!r:.40}"
        )
    if budget < 0:
        raise ValueError(f"plan(): budget_bytes must be >= 0, got {budget}")
    return budget


def make_plan(profile: MemoryProfile, budget_bytes: int) -> CheckpointPlan:
    """The least-FLOPs set of modules (none inside another) whose checkpointing fits the budget
    (see :func:`pareto_plans`); ties go to fewer modules, then fewer bytes."""
    if profile.per_region:
        raise PlanError(
            "plan(): this profile is per compiled region (a torch.compile'd model), where what is "
            "saved is the compiler's choice; profile the model before compiling it, plan there, "
            "apply the plan, then compile"
        )
    budget_bytes = _budget(budget_bytes)
    before = profile.total_saved_bytes
    flops = {r.name: r.flops_total for r in profile.rows}
    base, front = frontier(profile, budget_bytes)
    chosen: list[str] | None = None
    for _f, _k, kept, names in front.plans:  # cheapest first
        if base + kept <= budget_bytes and saved_after(profile, names) <= budget_bytes:
            chosen = names
            break
    if chosen is None:
        least = frontier(profile, budget_bytes, least=True)
        base, front = frontier(profile, least)  # the plans keeping that least
        _f, _k, kept, names = front.plans[-1]
        raise PlanError(
            f"plan(): no set of modules to checkpoint brings the {before:,} saved bytes under "
            f"the budget of {budget_bytes:,}; the lowest found is {base + kept:,} bytes "
            f"(checkpointing {names or 'nothing'}). Raise the budget, or make the batch smaller"
            + (
                f"; {len(profile.excluded)} module(s) were left out because checkpointing them "
                f"would change the gradients (profile.excluded: {sorted(profile.excluded)[:4]})"
                if profile.excluded
                else ""
            )
        )
    order = {r.name: i for i, r in enumerate(profile.rows)}
    chosen.sort(key=order.__getitem__)
    return CheckpointPlan(
        modules=chosen,
        budget_bytes=budget_bytes,
        saved_bytes_before=before,
        predicted_saved_bytes=saved_after(profile, chosen),
        recompute_flops=sum(flops[c] for c in chosen),
        drops={c: before - saved_after(profile, [c]) for c in chosen},
        exact=front.exact,
        excluded=dict(profile.excluded),
    )
