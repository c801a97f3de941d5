"""The two runs of a patching experiment: their inputs, and the check that they align.

The arguments of ``patch_sweep`` / ``attribution_patch`` are checked before any forward: one of a
wrong type or out of range gets a one-line error naming it (never a raw error from deep inside,
never a value read as another: ``arg=1.0`` is not input 0, ``rows=2.5`` is not 2).

Patching copies an activation of one run into the other at the same token position, so the runs
must align token by token: same shapes, and padding at the same places (docs/pitfalls.md §33; nnsight #672
patched the wrong positions of left-padded batches silently). Anything else raises
:class:`PatchingError` naming the rows and positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import strip_compiled
from ..core._errors import HookscopeError
from ..core._signature import accepts, forward_parameters

__all__ = [
    "PatchingArgumentError",
    "PatchingError",
    "as_kwargs",
    "batch_size",
    "check_aligned",
    "check_common",
    "check_count",
]


class PatchingError(HookscopeError):
    """A patching experiment that cannot give a meaningful answer: runs that do not align, a site
    that does not exist, an activation of the wrong shape."""


class PatchingArgumentError(PatchingError, ValueError, TypeError):
    """An argument of a wrong type or value (also a ``ValueError``/``TypeError``, as Python's own
    argument errors are)."""


def check_count(value: Any, name: str, meaning: str) -> None:
    """Raise unless ``value`` is ``None`` or an int >= 1 (a bool is not a count)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise PatchingArgumentError(
            f"{name} must be an int >= 1 ({meaning}) or None, got {type(value).__name__} {value!r}"
        )
    if value < 1:
        raise PatchingArgumentError(f"{name} must be >= 1 ({meaning}), got {value}")


def check_common(
    what: str, metric: Callable[..., Any], at: Any, arg: Any, reverse: Any, head_proj: Any
) -> None:
    """The arguments both sweeps share (``over``, ``layers`` and ``n_heads`` are checked where
    they are resolved)."""
    if not callable(metric):
        raise PatchingArgumentError(
            f"{what}: metric must be a function metric(output) -> scalar, got "
            f"{type(metric).__name__}; e.g. lambda out: out.logits[:, -1, i].mean()"
        )
    if not isinstance(at, str) or at not in ("output", "input"):
        raise PatchingArgumentError(f"{what}: at must be 'output' or 'input', got {at!r}")
    if arg is not None:
        if at != "input":
            raise PatchingArgumentError(
                f"{what}: arg= selects an input; use it with at='input' (got arg={arg!r} with "
                f"at={at!r})"
            )
        if isinstance(arg, bool) or not isinstance(arg, (int, str)):
            raise PatchingArgumentError(
                f"{what}: arg must be a positional index (an int >= 0) or a keyword name (a str), "
                f"got {type(arg).__name__} {arg!r}"
            )
        if isinstance(arg, int) and arg < 0:
            raise PatchingArgumentError(
                f"{what}: arg must be a positional index >= 0 or a keyword name, got {arg}"
            )
    if not isinstance(reverse, bool):
        raise PatchingArgumentError(
            f"{what}: reverse must be True or False, got {type(reverse).__name__} {reverse!r}"
        )
    if head_proj is not None and not isinstance(head_proj, str):
        raise PatchingArgumentError(
            f"{what}: head_proj must be the name of the output projection under the attention "
            f"module (a str, e.g. 'o_proj') or None, got {type(head_proj).__name__} {head_proj!r}"
        )


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
    for key, value in kwargs.items():
        if value is not None and (
            key in ("past_key_values", "cache_params")
            or callable(getattr(value, "get_seq_length", None))
        ):
            raise PatchingArgumentError(
                f"{key!r} in {what} holds a cache ({type(value).__name__}), which every forward of "
                "the sweep would add to (changing your cache, and each run's positions); pass the "
                "whole sequence's token ids instead (a causal model's sweep reuses the earlier "
                "positions' keys and values itself)"
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
