"""hookscope: look inside and steer any PyTorch model through hooks, without editing its class.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> with hs.capture(net, "1") as cap:
    ...     _ = net(torch.randn(5, 3))
    >>> cap["1"].shape
    torch.Size([5, 4])
"""

from __future__ import annotations

from . import ops
from ._capture import Call, Capture, Inputs, capture
from ._edit import clip_grads, edit, edit_grads
from ._errors import (
    HookConflictError,
    HookscopeError,
    HookscopeWarning,
    InPlaceModifiedWarning,
    LayerNotFoundError,
    LayerNotRunError,
    NoGradientError,
    UnsupportedModelError,
)
from ._extractor import FeatureExtractor
from ._inventory import HookInfo, hooks_on, remove_hooks
from ._observe import TensorGrads, observe, tensor_grads
from ._scope import HookScope
from ._select import Selector, find
from ._trace import Trace, TraceEvent, trace

__version__ = "0.1.0"

__all__ = [
    "Call",
    "Capture",
    "FeatureExtractor",
    "HookConflictError",
    "HookInfo",
    "HookScope",
    "HookscopeError",
    "HookscopeWarning",
    "InPlaceModifiedWarning",
    "Inputs",
    "LayerNotFoundError",
    "LayerNotRunError",
    "NoGradientError",
    "Selector",
    "TensorGrads",
    "Trace",
    "TraceEvent",
    "UnsupportedModelError",
    "__version__",
    "capture",
    "clip_grads",
    "edit",
    "edit_grads",
    "find",
    "hooks_on",
    "observe",
    "ops",
    "remove_hooks",
    "tensor_grads",
    "trace",
]
