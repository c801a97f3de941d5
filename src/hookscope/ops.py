"""Ready-made edits for :func:`hookscope.edit` and :func:`hookscope.edit_grads` (the public face of
:mod:`hookscope.core._ops`).

Example:
    >>> import torch, hookscope as hs
    >>> hs.ops.clamp(min=0)(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
"""

from .core._ops import Op, ablate, add, clamp, clip_norm, replace, scale, zero

__all__ = ["Op", "ablate", "add", "clamp", "clip_norm", "replace", "scale", "zero"]
