"""Training health: per-layer and per-parameter statistics, alerts, sinks, the NaN/Inf origin."""

from ._diagnose import Alert, MonitorWarning, NonFiniteWarning, Thresholds
from ._monitor import Monitor
from ._nonfinite import NonFiniteOrigin, find_nonfinite
from ._plot import plot_grad_flow
from ._record import MonitorRecord
from ._sinks import JsonlSink, MlflowSink, TensorBoardSink, WandbSink

__all__ = [
    "Alert",
    "JsonlSink",
    "MlflowSink",
    "Monitor",
    "MonitorRecord",
    "MonitorWarning",
    "NonFiniteOrigin",
    "NonFiniteWarning",
    "TensorBoardSink",
    "Thresholds",
    "WandbSink",
    "find_nonfinite",
    "plot_grad_flow",
]
