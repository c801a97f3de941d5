"""hookscope: look inside and steer any PyTorch model through hooks, without editing its class.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> with hs.capture(net, "1") as cap:
    ...     _ = net(torch.randn(5, 3))
    >>> cap["1"].shape
    torch.Size([5, 4])
"""

from . import ops
from ._cam import CAM, CAMError, cam_methods, get_cam
from ._cam_methods import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from ._capture import Call, Capture, Inputs, capture
from ._demo import DemoNet, load_demo_model
from ._demo_data import DemoDataset, make_demo_dataset
from ._diagnose import Alert, MonitorWarning, NonFiniteWarning, Thresholds
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
from ._extract import extract
from ._extractor import FeatureExtractor
from ._featstore import ExtractError, Features, IncompleteExtractionError, load_features
from ._flowplot import plot_grad_flow
from ._imagefolder import ImageFolder
from ._inventory import HookInfo, hooks_on, remove_hooks
from ._monitor import Monitor
from ._nonfinite import NonFiniteOrigin, find_nonfinite
from ._observe import TensorGrads, observe, tensor_grads
from ._record import MonitorRecord
from ._scope import HookScope
from ._select import Selector, find
from ._sinks import JsonlSink, TensorBoardSink
from ._summary import Summary, SummaryRow, SummaryTotals, summary
from ._tokens import ReshapeError
from ._trace import Trace, TraceEvent, trace
from ._viz import feature_maps, overlay

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "CAM",
    "CAMError",
    "Call",
    "Capture",
    "DemoDataset",
    "DemoNet",
    "EigenCAM",
    "ExtractError",
    "FeatureExtractor",
    "Features",
    "GradCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "HookConflictError",
    "HookInfo",
    "HookScope",
    "HookscopeError",
    "HookscopeWarning",
    "ImageFolder",
    "InPlaceModifiedWarning",
    "IncompleteExtractionError",
    "Inputs",
    "JsonlSink",
    "LayerCAM",
    "LayerNotFoundError",
    "LayerNotRunError",
    "Monitor",
    "MonitorRecord",
    "MonitorWarning",
    "NoGradientError",
    "NonFiniteOrigin",
    "NonFiniteWarning",
    "ReshapeError",
    "ScoreCAM",
    "Selector",
    "Summary",
    "SummaryRow",
    "SummaryTotals",
    "TensorBoardSink",
    "TensorGrads",
    "Thresholds",
    "Trace",
    "TraceEvent",
    "UnsupportedModelError",
    "XGradCAM",
    "__version__",
    "cam_methods",
    "capture",
    "clip_grads",
    "edit",
    "edit_grads",
    "extract",
    "feature_maps",
    "find",
    "find_nonfinite",
    "get_cam",
    "hooks_on",
    "load_demo_model",
    "load_features",
    "make_demo_dataset",
    "observe",
    "ops",
    "overlay",
    "plot_grad_flow",
    "remove_hooks",
    "summary",
    "tensor_grads",
    "trace",
]
