"""Class activation maps: the Grad-CAM family over one template, and ViT/Swin token reshaping."""

from ._base import CAM, CAMError, cam_methods, get_cam
from ._methods import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from ._tokens import ReshapeError

__all__ = [
    "CAM",
    "CAMError",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "LayerCAM",
    "ReshapeError",
    "ScoreCAM",
    "XGradCAM",
    "cam_methods",
    "get_cam",
]
