"""``MonitorRecord``: what one logged training step recorded, JSON-ready."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._diagnose import Alert
from ._nonfinite import NonFiniteOrigin

__all__ = ["MonitorRecord"]


@dataclass
class MonitorRecord:
    """What one logged step recorded.

    Attributes:
        step: the step index (0 for the first ``step()``).
        layers: ``{layer: {stat: value}}`` in call order; a layer called again in the same
            forward pass appears as ``"layer#1"``, ``"layer#2"``; the forward passes of one
            optimizer step (micro-batches, or several calls of the model) add to the same entries. Stats: ``mean``, ``std``, ``absmax``,
            ``zeros`` (fraction exactly zero), ``nonfinite`` (count), ``saturated`` (fraction, for
            Tanh/Sigmoid-like layers), ``grad_norm`` and ``grad_absmax`` (gradient w.r.t. the
            output, unscaled when a ``GradScaler`` is given; under torch.distributed, of the mean
            of the ranks' losses, as DDP averages gradients).
        params: ``{parameter: {stat: value}}``: ``grad_norm`` (absent when the parameter got
            no gradient; the averaged gradient under DDP), ``weight_norm`` and, with an optimizer,
            ``update_ratio`` = ``|w_after - w_before| / |w_before|``, absent on the step a
            parameter was set to train, replaced or resized (after the monitor copied the values before
            the step; a :class:`MonitorWarning` names it, once). A parameter with a gradient
            that the optimizer does not hold has ``update_ratio`` 0, with a warning.
        alerts: diagnoses of this step (:class:`Alert`).
        nonfinite: where the first NaN/Inf came from (sentinel mode), or ``None``.
        histograms: ``{tag: (bucket_limits, counts)}`` when histograms were requested.
        histogram_sums: ``{tag: (sum, sum of squares)}`` of the values each histogram binned
            (those of the step's first micro-batch), where they are not the layer's
            statistics over the whole step: a step with several micro-batches.
        skipped: with a ``GradScaler``, whether it skipped this optimizer step (non-finite
            gradients: the weights did not change); ``None`` without one.
    """

    step: int
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    params: dict[str, dict[str, float]] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    nonfinite: NonFiniteOrigin | None = None
    histograms: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    skipped: bool | None = None
    histogram_sums: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def scalars(self, prefix: str = "hookscope") -> dict[str, float]:
        """The record as flat scalars for a tracker: ``"{prefix}/{layer}/{stat}"`` and
        ``"{prefix}/params/{parameter}/{stat}"``. A repeated call ``"layer#1"`` is named
        ``"layer.call1"`` (``#`` is not allowed in MLflow metric names); the root module is
        ``"<root>"``. With a ``GradScaler``, ``"{prefix}/skipped"`` is 1.0 for a step it skipped,
        else 0.0.

        Example:
            >>> from hookscope import MonitorRecord
            >>> MonitorRecord(3, {"fc#1": {"mean": 0.5}}, {"fc.bias": {"grad_norm": 2.0}}).scalars()
            {'hookscope/fc.call1/mean': 0.5, 'hookscope/params/fc.bias/grad_norm': 2.0}
        """
        out: dict[str, float] = {}
        for layer, stats in self.layers.items():
            name = (layer or "<root>").replace("#", ".call")
            for k, v in stats.items():
                out[f"{prefix}/{name}/{k}"] = v
        for pname, stats in self.params.items():
            for k, v in stats.items():
                out[f"{prefix}/params/{pname}/{k}"] = v
        if self.skipped is not None:
            out[f"{prefix}/skipped"] = float(self.skipped)
        return out

    def to_dict(self, *, histograms: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``).

        With ``histograms=True`` (what :class:`JsonlSink` writes), a record with histograms also
        has ``"histograms"``: ``{tag: [bucket_limits, counts]}``, and, where it has them,
        ``"histogram_sums"``: ``{tag: [sum, sum of squares]}``.
        """

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return v

        nf = None
        if self.nonfinite is not None:
            o = self.nonfinite
            nf = {
                "layer": o.layer,
                "phase": o.phase,
                "call": o.call,
                "kind": o.kind,
                "module_type": o.module_type,
                "stats": o.stats,
                "argument": o.argument,
            }
        out = {
            "step": self.step,
            "layers": self.layers,
            "params": self.params,
            "alerts": [a.to_dict() for a in self.alerts],
            "nonfinite": nf,
            "skipped": self.skipped,
        }
        if histograms and self.histograms:
            out["histograms"] = {t: [list(a), list(c)] for t, (a, c) in self.histograms.items()}
            if self.histogram_sums:
                out["histogram_sums"] = {t: list(v) for t, v in self.histogram_sums.items()}
        return clean(out)
