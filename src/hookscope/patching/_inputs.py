"""The two runs of a patching experiment: their inputs, and the check that they align.

Patching copies an activation of one run into the other at the same token position, so the runs
must align token by token: same shapes, and padding at the same places (docs/pitfalls.md §33; nnsight #672
patched the wrong positions of left-padded batches silently). Anything else raises
:class:`PatchingError` naming the rows and positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import strip_compiled
from ..core._errors import HookscopeError
from ..core._signature import accepts, forward_parameters

__all__ = ["PatchingError", "as_kwargs", "batch_size", "check_aligned"]


class PatchingError(HookscopeError):
    """A patching experiment that cannot give a meaningful answer: runs that do not align, a site
    that does not exist, an activation of the wrong shape."""


def _first_param(model: nn.Module) -> str:
    for p in forward_parameters(model).values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return "input_ids"


def as_kwargs(model: nn.Module, inputs: Any, what: str) -> dict[str, Any]:
    """``inputs`` (a tensor of token ids, or a dict of the model's keyword inputs) as keyword
    arguments; ``use_cache=False`` is added where the model takes it (a sweep needs no cache)."""
    if isinstance(inputs, torch.Tensor):
        kwargs: dict[str, Any] = {_first_param(model): inputs}
    elif isinstance(inputs, Mapping):
        kwargs = dict(inputs)
    else:
        raise TypeError(
            f"{what} must be a tensor of token ids or a dict of the model's keyword inputs "
            f"(input_ids, attention_mask, ...); got {type(inputs).__name__}"
        )
    if "use_cache" not in kwargs and accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def batch_size(kwargs: dict[str, Any]) -> int:
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and v.ndim:
            return int(v.shape[0])
    raise PatchingError("the inputs hold no tensor with a batch dimension")


def _positions(mask: torch.Tensor) -> str:
    idx = mask.nonzero().tolist()
    shown = ", ".join(f"(row {r}, position {p})" for r, p, *_ in idx[:6])
    return shown + (f" and {len(idx) - 6} more" if len(idx) > 6 else "")


def check_aligned(model: nn.Module, clean: dict[str, Any], corrupt: dict[str, Any]) -> None:
    """Raise :class:`PatchingError` unless the two runs align token by token."""
    keys = sorted(k for k, v in {**clean, **corrupt}.items() if isinstance(v, torch.Tensor))
    for k in keys:
        a, b = clean.get(k), corrupt.get(k)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            missing = "clean" if not isinstance(a, torch.Tensor) else "corrupt"
            raise PatchingError(
                f"{k!r} is given for one run only (missing in {missing}); give both runs the same "
                "inputs, e.g. the attention_mask of each"
            )
        if a.shape != b.shape:
            raise PatchingError(
                f"the clean and corrupted runs do not align: {k!r} has shape {tuple(a.shape)} "
                f"against {tuple(b.shape)}; patching copies activations position by position, so "
                "tokenize both prompts to the same length (same padding)"
            )
    mask_a, mask_b = clean.get("attention_mask"), corrupt.get("attention_mask")
    if isinstance(mask_a, torch.Tensor) and isinstance(mask_b, torch.Tensor):
        differ = mask_a != mask_b
        if differ.any():
            raise PatchingError(
                "the clean and corrupted runs are padded differently: their attention_mask "
                f"differs at {_positions(differ)}; a patch there would copy a padding position "
                "into a token (or the reverse). Pad both prompts to the same positions"
            )
        return
    pad = getattr(getattr(strip_compiled(model), "config", None), "pad_token_id", None)
    ids_a, ids_b = clean.get("input_ids"), corrupt.get("input_ids")
    if (
        isinstance(pad, int)
        and isinstance(ids_a, torch.Tensor)
        and isinstance(ids_b, torch.Tensor)
        and ids_a.dtype in (torch.int64, torch.int32)
    ):
        differ = (ids_a == pad) != (ids_b == pad)
        if differ.any():
            raise PatchingError(
                f"the clean and corrupted runs have padding (token {pad}) at different places: "
                f"{_positions(differ)}; pad both prompts to the same positions and pass their "
                "attention_mask"
            )
