"""Activation patching at sweep scale: ``patch_sweep`` (layers x positions x heads in batched
passes), ``attribution_patch`` (every site from two forwards and one backward), a heat map."""

from ._inputs import PatchingError
from ._sweep import Metric, patch_sweep

__all__ = ["Metric", "PatchingError", "patch_sweep"]
