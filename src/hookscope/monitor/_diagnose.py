"""Training-health diagnosis: thresholds, alerts, and the rules that turn statistics into alerts.

The rules read one monitor record (plus the previous one, for growth) and name the layer and the
numbers behind every alert, so a user can act on the message alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..core._errors import HookscopeWarning

__all__ = ["Alert", "MonitorWarning", "NonFiniteWarning", "Thresholds", "diagnose"]


class MonitorWarning(HookscopeWarning):
    """An alert of the training monitor (vanishing, exploding, dead units, saturation)."""


class NonFiniteWarning(MonitorWarning):
    """A NaN or Inf appeared; the message names the layer (or the input) that produced it."""


@dataclass(frozen=True)
class Thresholds:
    """When the monitor raises an alert. Pass a ``Thresholds`` or a dict of the fields to change.

    Attributes:
        vanishing: alert when the gradient norm of the first layer divided by that of the last
            layer falls below this (``1e-4``: four orders of magnitude).
        exploding: alert when any gradient norm (of a layer output or a parameter) exceeds this.
        growth: alert when a gradient norm grew by more than this factor since the last logged step.
        dead: alert when at least this fraction of a layer's output is exactly zero.
        saturation: alert when at least this fraction of a Tanh/Sigmoid-like output lies within
            ``saturation_margin`` of its bounds.
        saturation_margin: distance from a bound that counts as saturated, as a fraction of
            the activation's range ``high - low``: ``0.01`` is within 0.02 of Tanh's -1 and 1,
            within 0.01 of Sigmoid's 0 and 1, within 0.1 of ``Hardtanh(-5, 5)``'s bounds.

    Example:
        >>> Thresholds.make({"dead": 0.5}).dead
        0.5
    """

    vanishing: float = 1e-4
    exploding: float = 1e3
    growth: float = 100.0
    dead: float = 0.95
    saturation: float = 0.9
    saturation_margin: float = 0.01

    @classmethod
    def make(cls, value: Thresholds | Mapping[str, float] | None) -> Thresholds:
        """Build from ``None`` (defaults), a ``Thresholds`` or a mapping of fields to change."""
        if value is None:
            return cls()
        if isinstance(value, Thresholds):
            return value
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown threshold(s) {unknown}; valid: {sorted(names)}")
        return replace(cls(), **{k: float(v) for k, v in value.items()})


@dataclass(frozen=True)
class Alert:
    """One diagnosis of a logged step.

    Attributes:
        kind: ``vanishing``, ``exploding``, ``dead``, ``saturation`` or ``nonfinite`` (a
            layer output with NaN/Inf values, or non-finite gradient norms: one alert naming
            the first, ``values["layers"]`` all of them).
        layer: the layer or parameter it is about.
        step: the step it was found in.
        message: one line for people (what the monitor warns or logs).
        values: the numbers behind it, e.g. ``{"grad_norm": 1e6}``.
    """

    kind: str
    layer: str
    step: int
    message: str
    values: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def diagnose(
    step: int,
    layers: Mapping[str, Mapping[str, float]],
    params: Mapping[str, Mapping[str, float]],
    previous: tuple[Mapping[str, Mapping[str, float]], Mapping[str, Mapping[str, float]]] | None,
    th: Thresholds,
    allowed: frozenset[str] | set[str] = frozenset(),
    skipped: bool | None = None,
) -> list[Alert]:
    """Alerts for one record. ``layers``/``params`` map names (in model order) to statistics;
    layers in ``allowed`` may hold non-finite values on purpose (e.g. ``-inf`` masks).
    ``skipped``: a GradScaler skipped this step (its scaled gradients overflowed, as mixed
    precision expects now and then: the weights did not change, the record says so), so its
    non-finite gradient norms raise no alert."""
    alerts: list[Alert] = []

    def add(kind: str, layer: str, message: str, **values: Any) -> None:
        alerts.append(Alert(kind, layer, step, f"step {step}: {message}", values))

    for name, s in layers.items():
        n = s.get("nonfinite", 0.0)
        if n > 0 and name.partition("#")[0] not in allowed:
            add(
                "nonfinite",
                name,
                f"layer {name!r} output has {int(n)} non-finite values",
                nonfinite=n,
            )
        z = s.get("zeros", 0.0)
        if z >= th.dead:
            add(
                "dead",
                name,
                f"layer {name!r}: {z:.1%} of its output is exactly zero (dead units; threshold {th.dead:.0%})",
                zeros=z,
            )
        sat = s.get("saturated")
        if sat is not None and sat >= th.saturation:
            add(
                "saturation",
                name,
                f"layer {name!r}: {sat:.1%} of its output is saturated (threshold {th.saturation:.0%})",
                saturated=sat,
            )

    # exploding: absolute, then growth since the previous logged step; a non-finite gradient
    # norm (inf or NaN gradient values, or finite ones whose norm overflowed) is one alert
    prev_layers, prev_params = previous if previous is not None else ({}, {})
    bad: list[tuple[str, str, float]] = []
    for group, prev, label, key in (
        (layers, prev_layers, "output gradient", "grad_norm"),
        (params, prev_params, "gradient", "grad_norm"),
    ):
        for name, s in group.items():
            g = s.get(key)
            if g is None:
                continue
            if not math.isfinite(g):
                bad.append((label, name, g))
                continue
            if g > th.exploding:
                add(
                    "exploding",
                    name,
                    f"{label} norm of {name!r} is {_fmt(g)} (> {_fmt(th.exploding)})",
                    grad_norm=g,
                )
                continue
            p = prev.get(name, {}).get(key)
            if p is not None and p > 0 and math.isfinite(p) and g / p > th.growth:
                add(
                    "exploding",
                    name,
                    f"{label} norm of {name!r} grew {_fmt(g / p)}x since the last logged step ({_fmt(p)} -> {_fmt(g)})",
                    grad_norm=g,
                    previous=p,
                )

    if bad and not skipped:
        label, name, g = bad[0]
        more = (
            f" and {len(bad) - 1} more ({', '.join(repr(n) for _, n, _ in bad[1:4])}{', ...' if len(bad) > 4 else ''})"
            if len(bad) > 1
            else ""
        )
        add(
            "nonfinite",
            name,
            f"{label} norm of {name!r} is {g}{more}: non-finite gradients (a GradScaler skips "
            "such a step; without one the optimizer writes them into the weights: "
            "Monitor(sentinel=True) or hs.find_nonfinite names the layer they come from)",
            grad_norm=g,
            layers=[n for _, n, _ in bad],
        )

    # vanishing: first vs last layer (model order) that has a gradient norm
    for group, label in ((layers, "output gradient"), (params, "gradient")):
        normed = [
            (n, s["grad_norm"])
            for n, s in group.items()
            if "grad_norm" in s and math.isfinite(s["grad_norm"])
        ]
        if len(normed) < 2:
            continue
        (first, g0), (last, g1) = normed[0], normed[-1]
        if g1 > 0 and g0 / g1 < th.vanishing:
            add(
                "vanishing",
                first,
                f"{label} norm vanishes: {_fmt(g0)} at {first!r} vs {_fmt(g1)} at {last!r} (ratio {_fmt(g0 / g1)} < {_fmt(th.vanishing)})",
                grad_norm=g0,
                last_layer=last,
                last_grad_norm=g1,
            )
        break  # one vanishing verdict per record: layers when available, else parameters
    return alerts
