"""The engine every product is built on: layer selection, hook scopes, nested-output walking, call
records, capture, edit, observe, trace and the hook inventory. It imports no product."""

from ._blocks import blocks
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
    ScopeReusedError,
    UnsupportedModelError,
    UnsupportedTensorError,
)
from ._inventory import HookInfo, hooks_on, remove_hooks
from ._observe import TensorGrads, observe, tensor_grads
from ._scope import HookScope
from ._select import Selector, find, resolve
from ._sequence import SequenceError, TokenSequence
from ._trace import Trace, TraceEvent, trace

__all__ = [
    "Call",
    "Capture",
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
    "ScopeReusedError",
    "Selector",
    "SequenceError",
    "Trace",
    "TraceEvent",
    "TensorGrads",
    "TokenSequence",
    "UnsupportedModelError",
    "UnsupportedTensorError",
    "blocks",
    "capture",
    "clip_grads",
    "edit",
    "edit_grads",
    "find",
    "hooks_on",
    "observe",
    "remove_hooks",
    "resolve",
    "tensor_grads",
    "trace",
]
