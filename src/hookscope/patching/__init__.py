"""Activation patching at sweep scale: ``patch_sweep`` (layers x positions x heads in batched
passes), ``attribution_patch`` (every site from two forwards and one backward), a heat map."""

from ._attribution import attribution_patch
from ._heads import HeadSplitError
from ._inputs import PatchingError
from ._plot import plot_patching
from ._sweep import PatchMetric, patch_sweep

__all__ = [
    "HeadSplitError",
    "PatchMetric",
    "PatchingError",
    "attribution_patch",
    "patch_sweep",
    "plot_patching",
]
