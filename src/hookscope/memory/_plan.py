"""``MemoryProfile.plan``: which modules to checkpoint to fit a budget, at the least recompute."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core._errors import HookscopeError

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
            checkpointing keeps the module's positional inputs.
        recompute_flops: forward FLOPs run again in backward.
        drops: per module, the bytes checkpointing it alone would free.

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

    @property
    def predicted_drop(self) -> int:
        return self.saved_bytes_before - self.predicted_saved_bytes

    def __str__(self) -> str:
        from ..core._errors import some_names

        return (
            f"checkpoint {len(self.modules)} module(s) ({some_names(self.modules, 6)}): saved "
            f"{self.saved_bytes_before:,} -> {self.predicted_saved_bytes:,} bytes (budget "
            f"{self.budget_bytes:,}), recompute {self.recompute_flops:,} FLOPs"
        )


def saved_after(profile: MemoryProfile, chosen: Iterable[str]) -> int:
    """Saved bytes predicted with ``chosen`` modules under non-reentrant checkpointing.

    What is saved outside every chosen module stays; what is saved inside one is dropped (the
    checkpoint's own hooks take it); each call of a chosen module keeps its positional tensor
    inputs. Unique storages are counted once.
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


def _nested(a: str, b: str) -> bool:
    """Whether one of two module names contains the other."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def make_plan(profile: MemoryProfile, budget_bytes: int) -> CheckpointPlan:
    """Greedy: add the module with the most bytes freed per recompute FLOP (replacing chosen
    modules inside it), until the budget is met; then drop modules the budget does not need."""
    if profile.per_region:
        raise PlanError(
            "plan(): this profile is per compiled region (a torch.compile'd model), where what is "
            "saved is the compiler's choice; profile the model before compiling it, plan there, "
            "apply the plan, then compile"
        )
    if budget_bytes < 0:
        raise ValueError(f"plan(): budget_bytes must be >= 0, got {budget_bytes}")
    before = profile.total_saved_bytes
    flops = {r.name: r.flops_total for r in profile.rows}
    cost = {n: max(f, 1) for n, f in flops.items()}
    candidates = [r.name for r in profile.rows if r.name and r.calls > 0]
    drops = {n: before - saved_after(profile, [n]) for n in candidates}
    candidates = [n for n in candidates if drops[n] > 0]
    chosen: list[str] = []
    current = before
    while current > budget_bytes:
        best: tuple[float, str, int] | None = None
        for n in candidates:
            if n in chosen:
                continue
            if any(_nested(n, c) and len(c) < len(n) for c in chosen):
                continue  # inside a module already chosen
            trial = [c for c in chosen if not _nested(n, c)] + [n]
            after = saved_after(profile, trial)
            gain = current - after
            if gain <= 0:
                continue
            extra = cost[n] - sum(cost[c] for c in chosen if _nested(n, c))
            score = gain / max(extra, 1)
            if best is None or score > best[0]:
                best = (score, n, after)
        if best is None:
            raise PlanError(
                f"plan(): no set of modules to checkpoint brings the {before:,} saved bytes under "
                f"the budget of {budget_bytes:,}; the lowest found is {current:,} bytes "
                f"(checkpointing {chosen or 'nothing'}). Raise the budget, or make the batch smaller"
            )
        _, name, current = best
        chosen = [c for c in chosen if not _nested(name, c)] + [name]
    # prune: drop the costliest modules the budget does not need
    for name in sorted(chosen, key=lambda c: -cost[c]):
        trial = [c for c in chosen if c != name]
        after = saved_after(profile, trial)
        if after <= budget_bytes:
            chosen, current = trial, after
    order = {r.name: i for i, r in enumerate(profile.rows)}
    chosen.sort(key=order.__getitem__)
    return CheckpointPlan(
        modules=chosen,
        budget_bytes=budget_bytes,
        saved_bytes_before=before,
        predicted_saved_bytes=current,
        recompute_flops=sum(flops[c] for c in chosen),
        drops={c: drops[c] for c in chosen},
    )
