"""What the command line can tell about a model before running it, and the hint added to a model's
error naming the option that fixes it (``--dtype long``, ``--resize``/``--crop``, ``--input``)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["check_positions", "token_input", "vocabulary", "with_hint"]


def token_input(model: Any) -> str | None:
    """The name of the model's main input when it is token ids (a Hugging Face model whose
    ``main_input_name`` is ``input_ids``), else ``None``."""
    name = getattr(model, "main_input_name", None)
    return name if name == "input_ids" else None


def _embeddings(model: Any) -> list[nn.Embedding]:
    if not isinstance(model, nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


def vocabulary(model: Any) -> int | None:
    """How many token ids the model's input embedding takes (Hugging Face's
    ``get_input_embeddings()``, else the first ``nn.Embedding``); ``None`` without one."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if not isinstance(emb, nn.Embedding):
        found = _embeddings(model)
        emb = found[0] if found else None
    return emb.num_embeddings if emb is not None else None


def check_positions(
    model: Any, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
) -> str | None:
    """A message when the token sequence of ``shapes`` is longer than the learned position
    embedding of a Hugging Face model takes (``max_position_embeddings`` / ``n_positions``), else
    ``None``. Models without a position embedding of that size (rotary positions) are not limited."""
    config = getattr(model, "config", None)
    if config is None or dtype.is_floating_point or not shapes or len(shapes[0]) < 2:
        return None
    for attr in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, attr, None)
        if isinstance(limit, int) and any(e.num_embeddings == limit for e in _embeddings(model)):
            seq = shapes[0][-1]
            if seq > limit:
                shown = ",".join(str(d) for d in shapes[0])
                return (
                    f"--input {shown}: the model takes at most {limit} positions "
                    f"(config.{attr}); give a sequence of at most {limit} tokens"
                )
    return None


_TOKENS = re.compile(r"'indices' to have one of the following scalar types|arguments for embedding")
_INDEX = re.compile(r"index out of range in self")
_RANK = re.compile(r"expected (\d)D input \(got (\d)D input\)")
_FLOAT_LAYER = re.compile(
    r"expected scalar type \w+ but found Float|Input type \([\w ]+\) and (weight|bias) type"
)
_IMAGE = re.compile(r"image (size|height|width)|image_size", re.IGNORECASE)
_EXPECTED = (
    re.compile(r"Expected (\d+) but got \d+"),  # torchvision ViT
    re.compile(r"match model \((\d+)\*(\d+)\)"),  # Hugging Face ViT, DeiT, ...
)


def _image_side(message: str) -> int | None:
    for pattern in _EXPECTED:
        m = pattern.search(message)
        if m:
            return int(m.group(1))
    return None


def with_hint(message: str, args: argparse.Namespace | None) -> str:
    """``message`` with the option that fixes it appended, where the error names a known cause:
    float inputs given to an embedding (``--dtype long``), an embedding index past its size (token
    ids or sequence length), an image of another size than the model was built for
    (``--resize``/``--crop`` for image commands, ``--input`` for the others).

    Example:
        >>> import argparse
        >>> args = argparse.Namespace(input=["1,3,32,32"], dtype="float32")
        >>> with_hint("ValueError: Input image size (32*32) doesn't match model (64*64).", args)
        "ValueError: Input image size (32*32) doesn't match model (64*64); the model was built for 64x64 images: give --input 1,3,64,64"
    """
    given = vars(args) if args is not None else {}
    inputs = "input" in given  # --input/--dtype describe the model's input (not extract's)
    base = message.rstrip().rstrip(".!")
    if inputs and _TOKENS.search(message):
        return f"{base}; token ids need --dtype long"
    if inputs and _INDEX.search(message):
        return (
            f"{base}; an embedding got an index past its size: token ids must be below the "
            "vocabulary and the sequence (the last size of --input) within the model's positions"
        )
    if inputs and _FLOAT_LAYER.search(message) and not _floating(given.get("dtype")):
        return f"{base}; --dtype {given.get('dtype')} gives integer inputs, this layer takes floats: use --dtype float32"
    rank = _RANK.search(message) if inputs else None
    if rank is not None:
        return f"{base}; {_batch_hint(given, int(rank.group(1)))}"
    if not _IMAGE.search(message):
        return message
    side = _image_side(message)
    if "crop" in given:
        if side is None:
            return f"{base}; the model was built for another image size: set --resize and --crop"
        return f"{base}; the model was built for {side}x{side} images: add --resize {side} --crop {side}"
    if not inputs:
        return message
    if side is None:
        return f"{base}; the model was built for another image size: change --input"
    return f"{base}; the model was built for {side}x{side} images: give --input {_resized(given, side)}"


def _floating(dtype: Any) -> bool:
    t = getattr(torch, str(dtype), None)
    return not isinstance(t, torch.dtype) or t.is_floating_point


def _shape(given: dict[str, Any]) -> list[str]:
    """The sizes of the first ``--input`` shape, as given (``[]`` when it cannot be read)."""
    first = (given.get("input") or [""])[0].split(";")[0]
    parts = [p for p in re.split(r"[,x×]", first.strip().strip("()[]").replace(" ", "")) if p]
    return parts if parts and all(p.isdigit() for p in parts) else []


def _batch_hint(given: dict[str, Any], want: int) -> str:
    """A layer wanted ``want``-D input: most often the batch size is missing from ``--input``."""
    sizes = _shape(given)
    if len(sizes) == want - 1:
        return f"a batch size is missing from --input: give --input 1,{','.join(sizes)}"
    return f"the layer takes {want}-D input: check the sizes given to --input (batch first)"


def _resized(given: dict[str, Any], side: int) -> str:
    """The first ``--input`` shape with its last two sizes set to ``side`` (``1,3,side,side``
    when it cannot be read)."""
    parts = _shape(given)
    if len(parts) < 3:
        parts = ["1", "3", "", ""]
    return ",".join([*parts[:-2], str(side), str(side)])
