"""Token positions of language-model calls: what ``capture(sequence=True)`` and ``steer`` build on.

``model.generate()`` (and any loop of KV-cached forward calls) calls every layer once on the
prompt, then once per new token on one position; rows can be left-padded, and beam search
reorders them between calls (docs/pitfalls.md §32). A :class:`TokenTracker` is a ``with_kwargs`` forward
pre-hook on the root model that reads, for each model call, where its tokens sit:

* the **column** of the call's first token in the padded sequence: the width of a 2-D
  ``attention_mask`` minus the call's length (what ``generate`` and a hand loop pass), else
  ``past_key_values.get_seq_length()`` (dynamic and static caches), else ``cache_position``,
  else 0 (a full forward over a new sequence);
* which columns of each row are **real tokens**: the 2-D ``attention_mask``, or the last query
  row of a 4-D mask (what ``generate`` passes with a static cache: 0 or ``True`` = attended), else
  every column is real;
* the **tokens** (``input_ids``), kept so that the sequence can be read beside its values;
* a **reorder** of the rows between calls (beam search): the key cache of the last layer is
  compared, on the device and without a host sync, with what it held after the previous call.

A token's *position* is the number of real tokens before it in its row (what ``generate`` passes
as ``position_ids``). A 2-D mask whose width disagrees with the cache's length is not guessed
from: :meth:`Capture.sequence` raises naming the call. Limits: a model called with neither a mask, a cache nor ``cache_position``
is taken to start a new sequence at each call; a cache hookscope cannot read (not a Hugging Face
``Cache``) is not checked for reorders.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ._compiled import strip_compiled
from ._errors import HookscopeError
from ._nested import first_tensor
from ._scope import HookScope, in_backward

__all__ = ["SequenceError", "TokenSequence", "TokenTracker", "assemble"]


class SequenceError(HookscopeError):
    """Calls of a layer cannot be put together into one token-aligned sequence."""


class TokenSequence(NamedTuple):
    """A layer's values over a whole token sequence (see :meth:`Capture.sequence`).

    Attributes:
        values: ``[batch, positions, ...]``; ``values[b, p]`` is the layer's value at row ``b``'s
            ``p``-th real token (prompt and generated tokens alike), so rows of different prompt
            lengths line up token by token; positions past a row's end are zeros.
        mask: ``[batch, positions]`` bool, ``True`` where ``values`` holds a real token.
        tokens: ``[batch, positions]`` token ids in the same layout (the pad slots hold -1), or
            ``None`` when the model was called without ``input_ids``.
    """

    values: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor | None


class _Step:
    """One call of the root model: where its tokens sit."""

    __slots__ = (
        "_real",
        "batch",
        "conflict",
        "device",
        "marks",
        "mask",
        "n",
        "perm",
        "seq",
        "start",
        "tokens",
    )

    def __init__(self, start: int, n: int, batch: int, seq: int) -> None:
        self.start, self.n, self.batch, self.seq = start, n, batch, seq
        self.mask: Any = None  # the attention mask the call got (read when needed)
        self.conflict: str | None = None  # why the call's columns are uncertain
        self.device = torch.device("cpu")  # where the call's inputs are
        self._real: Any = _UNREAD
        self.tokens: torch.Tensor | None = None
        self.perm: tuple[torch.Tensor, torch.Tensor] | None = None  # (row map, matched) on device
        self.marks: dict[str, int] = {}

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def real(self) -> torch.Tensor | None:
        """``[batch, start + n]`` bool: the real-token columns so far (None: every column)."""
        if self._real is _UNREAD:
            self._real = _mask_2d(self.mask, self.end)
        return self._real


_UNREAD = object()


def _mask_2d(mask: Any, width: int) -> torch.Tensor | None:
    """Real-token columns ``[batch, width]`` from a 2-D or 4-D attention mask (None: unknown)."""
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() == 2:
        return mask[:, :width].bool() if mask.shape[1] >= width else None
    if mask.dim() == 4 and mask.shape[-1] >= width:
        last = mask[:, 0, -1, :width]  # the call's last query attends to every real token so far
        return last if last.dtype == torch.bool else last == 0
    return None


def _cache_keys(cache: Any) -> torch.Tensor | None:
    """The last layer's key tensor ``[batch, heads, columns, dim]`` of a Hugging Face cache."""
    layers = getattr(cache, "layers", None)
    if layers:
        keys = getattr(layers[-1], "keys", None)
    else:
        kc = getattr(cache, "key_cache", None)
        keys = kc[-1] if kc else None
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None


class TokenTracker:
    """Reads the token positions of every call of a model (see the module docstring).

    ``marks`` maps a layer name to a function giving how many calls of it were recorded so far;
    each step notes those counts, so that a layer's calls can be matched with the model calls.
    """

    def __init__(self, marks: dict[str, Any] | None = None) -> None:
        self.steps: list[_Step] = []
        self.marks = marks or {}
        self.prompt_end = 0  # the column where the current sequence's prompt ends
        self.current: _Step | None = None
        self._seq = 0
        self._after: tuple[torch.Tensor, int] | None = None  # (cache keys column, column)

    def attach(self, scope: HookScope, model: nn.Module, *, reorders: bool = True) -> None:
        """Add the pre-hook to the root model (and, with ``reorders``, the post-hook that keeps
        a column of the key cache to see beam search reorder the rows)."""
        root = strip_compiled(model)
        scope.add_forward_pre(root, self._pre, layer="", with_kwargs=True)
        if reorders:
            scope.add_forward(root, self._post, layer="", with_kwargs=True)

    def clear(self) -> None:
        self.steps.clear()
        self.current = None
        self._after = None
        self.prompt_end = 0

    # -- hooks ----------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if in_backward():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            self.current = None
            return
        batch, n = x.shape[0], x.shape[1]
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        cached = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else None
        conflict = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            start = mask.shape[1] - n
            if cached is not None and cached != start:
                conflict = (
                    f"its attention mask is {mask.shape[1]} columns wide for {n} new tokens, but "
                    f"the KV cache held {cached} tokens before it (a mask must cover the cached "
                    "and the new tokens, as generate() passes it)"
                )
        elif cached is not None:
            start = cached
        elif isinstance(kwargs.get("cache_position"), torch.Tensor):
            start = int(kwargs["cache_position"][0])
        else:
            start = 0
        tokens = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        prev = self.steps[-1] if self.steps else None
        if start == 0 and not self._recompute(prev, batch, n, tokens):
            self._seq += 1
            self.prompt_end = n
        step = _Step(start, n, batch, self._seq)
        step.conflict = conflict
        step.device = x.device
        step.mask = mask
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # a static cache's buffer: read now
            step.real  # noqa: B018
        step.tokens = tokens.detach().clone() if tokens is not None else None
        step.marks = {name: count() for name, count in self.marks.items()}
        after = self._after
        if after is not None and prev is not None and start > 0 and prev.batch == batch > 1:
            keys = _cache_keys(cache)
            col = after[1]
            if keys is not None and keys.shape[0] == batch and keys.shape[2] > col:
                now = keys[:, :, col].detach()
                same = (now[:, None] == after[0][None]).flatten(2).all(-1)  # [row now, row before]
                step.perm = (same.int().argmax(1), same.any(1))
        self._after = None
        self.steps.append(step)
        self.current = step

    def _post(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        step = self.current
        if step is None or step.batch == 1 or in_backward():  # one row cannot be reordered
            return
        keys = _cache_keys(kwargs.get("past_key_values"))
        col = step.end - 1
        if keys is not None and keys.shape[2] > col:
            self._after = (keys[:, :, col].detach().clone(), col)

    def _recompute(self, prev: _Step | None, batch: int, n: int, tokens: Any) -> bool:
        """A call from column 0 that re-runs the current sequence (``use_cache=False``)."""
        if prev is None or prev.batch != batch or n <= prev.end - 1 or tokens is None:
            return False
        known = _tokens_upto(self.steps, prev.seq, prev.end)
        return known is not None and torch.equal(tokens[:, : known.shape[1]], known)

    # -- per call (steering) --------------------------------------------------------------------
    def positions(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(position ids [batch, n], real [batch, n] or None)`` of the current call."""
        step = self.current
        if step is None:
            return None
        real = step.real
        if real is None:
            pos = torch.arange(step.start, step.end, device=step.device)
            return pos.expand(step.batch, step.n), None
        pos = real.to(step.device).cumsum(1) - 1
        return pos[:, step.start :], real[:, step.start :]


def _tokens_upto(steps: list[_Step], seq: int, end: int) -> torch.Tensor | None:
    out: torch.Tensor | None = None
    for s in steps:
        if s.seq != seq or s.tokens is None:
            continue
        if out is None:
            out = torch.full((s.batch, end), -1, dtype=s.tokens.dtype, device=s.tokens.device)
        out[:, s.start : s.end] = s.tokens
    return out


def assemble(tracker: TokenTracker, name: str, outputs: list[Any]) -> TokenSequence:
    """Put the recorded calls of layer ``name`` (``outputs``, in order) into one sequence."""
    for i, step in enumerate(tracker.steps):
        if step.conflict is not None:
            raise SequenceError(
                f"sequence({name!r}): model call {i} cannot be placed in the sequence: "
                f"{step.conflict}"
            )
    seqs = sorted({s.seq for s in tracker.steps})
    if not seqs:
        raise SequenceError(
            f"sequence({name!r}): the model was never called with token inputs (input_ids or "
            "inputs_embeds) while the capture was open"
        )
    if len(seqs) > 1:
        raise SequenceError(
            f"sequence({name!r}): the capture saw {len(seqs)} separate sequences (e.g. two "
            "generate() calls); open one capture per sequence, or call cap.clear() between them"
        )
    steps = tracker.steps
    counts = [*(s.marks.get(name, 0) for s in steps), len(outputs)]
    parts: list[torch.Tensor] = []
    for i, step in enumerate(steps):
        k = counts[i + 1] - counts[i]
        if k != 1:
            why = (
                "it did not run. A compiled forward that hookscope was not given ignores hooks: "
                "transformers' generate() compiles the forward by itself for a static cache on a "
                "GPU (pass disable_compile=True to generate), and so does model.forward = "
                "torch.compile(model.forward); compile with model.compile() or "
                "torch.compile(model) instead, which hookscope routes"
                if k == 0
                else "it ran several times in that call; sequence() needs one call per model call"
            )
            raise SequenceError(
                f"sequence({name!r}): layer {name!r} ran {k} times during model call {i} "
                f"(tokens {step.start}..{step.end - 1}): {why}"
            )
        t = first_tensor(outputs[counts[i]])
        if t is None or t.dim() < 2 or t.shape[0] != step.batch or t.shape[1] != step.n:
            shape = None if t is None else tuple(t.shape)
            raise SequenceError(
                f"sequence({name!r}): model call {i} had {step.batch} rows of {step.n} tokens, "
                f"but the layer's output (first tensor) has shape {shape}; sequence() needs "
                "outputs shaped [batch, tokens, ...]"
            )
        parts.append(t)
    return _build(steps, parts)


def _build(steps: list[_Step], parts: list[torch.Tensor]) -> TokenSequence:
    last = steps[-1]
    batch, width = last.batch, max(s.end for s in steps)
    ref = parts[-1]
    device = ref.device
    # the rows each step's row r became at the end (beam search reorders rows between calls)
    rowmaps: list[torch.Tensor] = [torch.arange(batch, device=device)] * len(steps)
    for i in range(len(steps) - 1, 0, -1):
        perm = steps[i].perm
        if perm is None:
            rowmaps[i - 1] = rowmaps[i]
            continue
        idx, matched = perm
        if not bool(matched.all()):
            raise SequenceError(
                f"model call {i}: rows were reordered between calls in a way hookscope could not "
                "follow (the key cache rows match no row of the previous call); read cap.calls() "
                "per call instead"
            )
        rowmaps[i - 1] = idx.to(device)[rowmaps[i]]
    for part in parts:
        if part.shape[0] != batch:
            raise SequenceError(
                f"the batch changed from {part.shape[0]} to {batch} rows between model calls; "
                "sequence() needs the same rows throughout"
            )
    contiguous = all(a.end == b.start for a, b in itertools.pairwise(steps)) and steps[0].start == 0
    if contiguous and all(s.perm is None for s in steps[1:]):  # the common case: one cat
        values = torch.cat([p.to(device) for p in parts], 1)
        toks = [s.tokens for s in steps]
        tokens = (
            None if any(t is None for t in toks) else torch.cat([t.to(device) for t in toks], 1)
        )
    else:
        values, tokens = _scatter(steps, parts, rowmaps, batch, width, ref)
    real = torch.ones(batch, width, dtype=torch.bool, device=device)
    hi = 0  # the latest mask of each column wins: walk back from the last call
    for step, rows in zip(reversed(steps), reversed(rowmaps)):
        r = step.real
        if r is not None and step.end > hi:
            real[:, hi : step.end] = r[:, hi : step.end].to(device)[rows]
            hi = step.end
    return _realign(values, real, tokens)


def _scatter(
    steps: list[_Step],
    parts: list[torch.Tensor],
    rowmaps: list[torch.Tensor],
    batch: int,
    width: int,
    ref: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each call's values at its columns, rows followed through reorders; later calls win."""
    device = ref.device
    values = ref.new_zeros((batch, width, *ref.shape[2:]))
    tokens: torch.Tensor | None = torch.full((batch, width), -1, dtype=torch.long, device=device)
    for step, part, rows in zip(steps, parts, rowmaps):
        values[:, step.start : step.end] = part.to(device)[rows]
        if tokens is not None:
            if step.tokens is None:
                tokens = None
            else:
                tokens[:, step.start : step.end] = step.tokens.to(device)[rows]
    return values, tokens


def _realign(
    values: torch.Tensor, real: torch.Tensor, tokens: torch.Tensor | None
) -> TokenSequence:
    """Move each row's real tokens to the front: column = position (real tokens before it)."""
    batch, device = values.shape[0], values.device
    lengths = real.sum(1)
    out_w = int(lengths.max())
    pos = real.long().cumsum(1) - 1
    b_idx, c_idx = real.nonzero(as_tuple=True)
    p_idx = pos[b_idx, c_idx]
    out = values.new_zeros((batch, out_w, *values.shape[2:]))
    out[b_idx, p_idx] = values[b_idx, c_idx]
    mask = torch.arange(out_w, device=device)[None] < lengths[:, None]
    toks = None
    if tokens is not None:
        toks = torch.full((batch, out_w), -1, dtype=torch.long, device=device)
        toks[b_idx, p_idx] = tokens[b_idx, c_idx]
    return TokenSequence(out, mask, toks)
