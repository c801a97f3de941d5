"""``steering_vector``: the mean activation difference of contrastive prompt pairs (CAA, ActAdd)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core._capture import capture
from ..core._compiled import named_modules, strip_compiled
from ..core._errors import HookscopeError, LayerNotRunError
from ..core._nested import first_tensor
from ..core._random import draw_fix, draw_place, random_draws
from ..core._scope import check_model, internal_run, model_device
from ..core._select import resolve
from ..core._signature import accepts

__all__ = ["steering_vector"]

Prompts = Sequence[str] | Sequence[Sequence[int]] | Sequence[torch.Tensor]


def _ids(prompts: Any, tokenizer: Any, what: str) -> list[torch.Tensor]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise HookscopeError(
                    f"steering_vector: {what}[{i}] is a string; pass tokenizer= to tokenize it, "
                    "or give token ids"
                )
            p = tokenizer(p)["input_ids"]
        t = torch.as_tensor(p)
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise HookscopeError(
                f"steering_vector: {what}[{i}] holds {t.dtype} values, not token ids; give "
                "integer ids (a float id would be truncated to another token)"
            )
        t = t.to(torch.long).flatten()
        if t.numel() == 0:
            raise HookscopeError(f"steering_vector: {what}[{i}] has no tokens")
        out.append(t)
    return out


@torch.no_grad()
def steering_vector(
    model: nn.Module,
    positive: Prompts,
    negative: Prompts,
    layers: Any,
    *,
    read: int = -1,
    tokenizer: Any = None,
    batch_size: int = 32,
) -> dict[str, torch.Tensor]:
    """A steering vector per layer: the mean over pairs of ``act(positive[i]) - act(negative[i])``.

    ``act`` is the layer's output (its hidden-state tensor: the first item of a tuple output) at
    token ``read`` of the prompt (``-1``: its last token; counted in the prompt's own tokens, so
    prompts of different lengths are handled). Prompts are strings (with ``tokenizer=``, called
    as ``tokenizer(prompt)``) or token ids. Each batch of ``batch_size`` pairs is one forward pass
    (positives and negatives together, padded on the right, which a causal model's real tokens
    never see), stopped after the last selected layer. This is what ``steering-vectors``'
    ``train_steering_vector(model, tokenizer, pairs, layers=[i], read_token_index=read)`` computes
    for layer ``i`` of the decoder blocks; here layers are named as everywhere in hookscope.

    Refused, each with one line naming the fix: a forward that draws random numbers (dropout in
    training mode, asked of the run itself: call ``model.eval()``), token ids that are not
    integers, a layer that does not run on the prompts, a model on the meta device, and a decoder
    layer of an encoder–decoder model (the prompts are the encoder's input: read an encoder layer).

    Returns ``{layer: vector}`` (shape ``[features]``), ready for :func:`steer`.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Embedding(4, 2))
        >>> v = hs.steering_vector(net, [[1, 2]], [[1, 3]], "0")["0"]
        >>> torch.equal(v, net[0].weight[2] - net[0].weight[3])
        True
    """
    with internal_run():  # a product's own run (see core._scope.internal_run)
        check_model(model)
        if len(positive) != len(negative):
            raise HookscopeError(
                f"steering_vector: {len(positive)} positive and {len(negative)} negative prompts; "
                "give one negative per positive (pairs)"
            )
        if not len(positive):
            raise HookscopeError("steering_vector: no prompt pairs given")
        if batch_size < 1:
            raise ValueError(f"steering_vector: batch_size must be >= 1, got {batch_size}")
        named = resolve(model, layers)
        _check_runnable(model, named)
        pos_ids, neg_ids = (
            _ids(positive, tokenizer, "positive"),
            _ids(negative, tokenizer, "negative"),
        )
        pad = getattr(tokenizer, "pad_token_id", None) or 0
        device = model_device(model)
        with_mask = accepts(model, "attention_mask", through_kwargs=True)
        diffs: dict[str, list[torch.Tensor]] = {n: [] for n in named}
        for lo in range(0, len(pos_ids), batch_size):
            rows = pos_ids[lo : lo + batch_size] + neg_ids[lo : lo + batch_size]
            half = len(rows) // 2
            lengths = torch.tensor([len(r) for r in rows])
            index = torch.where(torch.tensor(read) < 0, lengths + read, torch.tensor(read))
            bad = ((index < 0) | (index >= lengths)).nonzero().flatten().tolist()
            if bad:
                r = bad[0]
                which = "positive" if r < half else "negative"
                raise HookscopeError(
                    f"steering_vector: read={read} is outside {which}[{lo + r % half}], which has "
                    f"{int(lengths[r])} tokens; read must be in [-{int(lengths[r])}, {int(lengths[r]) - 1}]"
                )
            ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = r
                mask[i, : len(r)] = 1
            ids, mask = ids.to(device), mask.to(device)
            cap = _forward(model, named, ids, mask, with_mask, first=lo == 0)
            arange = torch.arange(len(rows), device=device)
            for name in named:
                h = first_tensor(cap[name])
                if h is None or h.dim() < 3 or h.shape[:2] != ids.shape:
                    raise HookscopeError(
                        f"steering_vector: layer {name!r} returned {None if h is None else tuple(h.shape)}"
                        f" for token ids of shape {tuple(ids.shape)}; it needs [batch, tokens, features]"
                    )
                acts = h[arange, index.to(device)]
                diffs[name].append(acts[:half] - acts[half:])
        return {name: torch.cat(d).mean(dim=0) for name, d in diffs.items()}


def _check_runnable(model: nn.Module, named: dict[str, nn.Module]) -> None:
    """Refuse a model without values (meta) and the decoder layers of an encoder-decoder model."""
    meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise HookscopeError(
            f"steering_vector: the model's parameters are on the meta device (e.g. {meta!r}), "
            "which holds no values; load the weights first (model.to_empty(device=...) then "
            "load_state_dict, or from_pretrained without a meta device map)"
        )
    root = strip_compiled(model)
    if not getattr(getattr(root, "config", None), "is_encoder_decoder", False):
        return
    get = getattr(root, "get_decoder", None)
    decoder = get() if callable(get) else None
    prefix = next((n for n, m in named_modules(model) if m is decoder and n), None)
    inside = [
        n for n in named if prefix is not None and (n == prefix or n.startswith(prefix + "."))
    ]
    if inside:
        raise HookscopeError(
            f"steering_vector: {inside[0]!r} is in the decoder ({prefix!r}) of the "
            f"encoder-decoder {type(root).__name__}, whose tokens are the decoder_input_ids, "
            "not the prompts; read a layer of the encoder (the prompts are its input), or "
            "compute the mean difference with hs.capture over your own decoder inputs"
        )


def _forward(
    model: nn.Module,
    named: dict[str, nn.Module],
    ids: torch.Tensor,
    mask: torch.Tensor,
    with_mask: bool,
    first: bool,
) -> Any:
    """One forward over a batch of prompts, stopped after the last selected layer (the capture
    is returned); the first batch checks that the run draws no random numbers."""
    root = strip_compiled(model)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if with_mask:
        kwargs["attention_mask"] = mask
    if getattr(getattr(root, "config", None), "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids[:, :1]  # the encoder layers run first; stopped there
    try:
        with random_draws(model) as draws, capture(model, named, stop=True) as cap:
            if with_mask or len(kwargs) > 1:
                model(**kwargs)
            else:
                model(ids)
    except LayerNotRunError:
        raise LayerNotRunError(
            f"steering_vector: layer(s) {', '.join(map(repr, cap.missing))} did not run in the "
            "forward over the prompts; read a layer that runs on token ids (e.g. one of "
            "hs.blocks(model)). Hooks see only calls made through module(...) in the thread "
            "that created the scope (docs/guide/core.md, Threads): a layer that the forward runs "
            "in a thread of its own is not seen; read a layer that the model calls in this thread"
        ) from None
    if first and draws.drew:

        def again() -> None:
            if with_mask or len(kwargs) > 1:
                model(**kwargs)
            else:
                model(ids)

        where = draw_place(model, again, kwargs)
        raise HookscopeError(
            f"steering_vector: the forward over the prompts draws random numbers{where}, so "
            f"every call would give another vector; {draw_fix(model)}"
        )
    return cap
