"""Pictures: CAM overlays and feature-map grids (matplotlib and pillow, imported on use)."""

from ._pictures import feature_maps, overlay

__all__ = ["feature_maps", "overlay"]
