"""Token positions of language-model calls: what ``capture(sequence=True)`` and ``steer`` build on.

``model.generate()`` (and any loop of cached forward calls) calls every layer once on the
prompt, then once per new token on one position; rows can be left-padded, and beam search
reorders them between calls (docs/pitfalls.md §32). A :class:`TokenTracker` is a ``with_kwargs`` forward
pre-hook on the root model that reads, for each model call, where its tokens sit:

* the **tokens**: ``input_ids`` (or ``inputs_embeds``); on an encoder–decoder model (T5, BART:
  ``config.is_encoder_decoder``) the decoder's, ``decoder_input_ids``, which are the tokens
  ``generate`` adds (the encoder runs once, over the source, outside the decoding calls);
* the **column** of the call's first token in the padded sequence: the width of a 2-D attention
  mask minus the call's length (what ``generate`` and a hand loop pass with a dynamic cache; a
  2-D mask as wide as a static cache's buffer, as Bloom's ``generate`` pads it: the cache's length),
  else the length of the Hugging Face cache (``past_key_values``: dynamic, static, sliding-window,
  quantized, encoder–decoder caches count every token they were given, also past a window), else
  ``cache_position``, else, for a cache whose length cannot be read (the recurrent state of a
  state-space model: Mamba's ``cache_params``), the end of the previous call when it got or
  returned the same cache object; else 0 (a full forward over a new sequence);
* which of the call's tokens are **real** (not padding): its columns of a 2-D mask, or the
  diagonal of a 4-D mask (``generate`` passes one with a static cache, alone or as a dict per
  attention kind: a query sees its own key unless it is padding, also under a sliding window);
  a mask of another kind (a flex ``BlockMask``) is read through ``position_ids`` only when they
  show no padding, otherwise the call is refused; no mask: every token is real;
* a **reorder** of the rows between calls (beam search): the cache's ``reorder_cache`` is
  wrapped while the scope is open, so the exact ``beam_idx`` of every reorder is known
  (also with a sliding window, whose cache no longer holds the early tokens);
  without a cache (``use_cache=False``: each call re-runs the sequence) a call whose rows each
  continue a row of the previous call (tokens and padding) is that re-run, rows reordered;
* the **prompt**: the first call of a sequence, or, while ``generate()`` runs (the model's
  ``generate`` is wrapped while the scope is open), the width of the ``input_ids`` it was given:
  prompt-lookup and assisted decoding run the prompt and the first candidates in one call.

A token's *position* is the number of real tokens before it in its row (what ``generate`` passes
as ``position_ids``). What cannot be placed exactly is refused, naming the call: a 2-D mask
whose width disagrees with the cache's length, an unreadable mask over padded rows, a call
that starts neither at 0 nor where the previous one ended without a mask to say where its
real tokens are, and a call read as a new sequence (neither a mask, a Hugging Face cache nor
``cache_position``) that is given an object the call before returned or changed and that holds
tensors (a hand-written KV cache). Limits: such a call is otherwise taken to start a new
sequence; where the call before changed the model's own tensors in place instead (a cache the
modules keep, as Meta's reference Llama does: a decoding step and a new prompt at 0 look
alike), a warning says so once; a cache without ``reorder_cache`` (not a Hugging Face
``Cache``) cannot be followed through beam search.
"""

from __future__ import annotations

import itertools
import threading
import types
import warnings
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ._compiled import strip_compiled
from ._errors import HookscopeError, HookscopeWarning
from ._nested import SCALARS, first_tensor, hidden_tensors, tensors_of
from ._scope import HookScope, _Hook, acts_here, get_ident, in_backward, quiet, thread_checked

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
            ``None`` when the model was called without token ids.
    """

    values: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor | None


class _Step:
    """One call of the root model: where its tokens sit."""

    __slots__ = (
        "_before",
        "_own",
        "batch",
        "carried",
        "conflict",
        "device",
        "marks",
        "mask2d",
        "n",
        "perm",
        "seq",
        "start",
        "tokens",
    )

    def __init__(self, start: int, n: int, batch: int, seq: int) -> None:
        self.start, self.n, self.batch, self.seq = start, n, batch, seq
        self.conflict: str | None = None  # why the call cannot be placed exactly
        # why a call read as a new sequence may continue the one before (state carried from it
        # in an object hookscope does not read): refused where the column matters
        self.carried: str | None = None
        self.device = torch.device("cpu")  # where the call's inputs are
        self.mask2d: torch.Tensor | None = None  # a 2-D mask over columns 0..end (read lazily)
        self._own: Any = None  # [batch, n] bool: real tokens (None: all)
        self._before: Any = start  # real tokens before the call per row: int or [batch]
        self.tokens: torch.Tensor | None = None
        self.perm: torch.Tensor | None = None  # row r of this call continues row perm[r] before
        self.marks: dict[str, int] = {}

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def own(self) -> torch.Tensor | None:
        """``[batch, n]`` bool: which of the call's tokens are real (None: all of them)."""
        if self._own is None and self.mask2d is not None:
            self._own = self.mask2d[:, self.start : self.end].bool()
        return self._own

    @property
    def before(self) -> Any:
        """Real tokens in the columns before the call, per row (int: the same for every row)."""
        if self._before is None and self.mask2d is not None:
            self._before = self.mask2d[:, : self.start].sum(1)
        return self._before

    def count(self) -> Any:
        """Real tokens up to the call's end per row (int or ``[batch]``)."""
        return self.before + (self.n if self.own is None else self.own.sum(1))


def _full_mask(mask: Any) -> Any:
    """The 4-D mask of a dict of masks per attention kind (``generate`` with a static cache)."""
    if isinstance(mask, dict):
        full = mask.get("full_attention")
        if isinstance(full, torch.Tensor):
            return full
        return next((m for m in mask.values() if isinstance(m, torch.Tensor)), None)
    return mask


def _own_real(mask: Any, start: int, n: int) -> tuple[torch.Tensor | None, bool]:
    """``(real [batch, n] or None, readable)``: the call's real tokens from its attention mask.

    A 4-D mask ``[batch, 1, queries, keys]`` covers the keys ``offset .. offset + keys``, where
    ``offset`` is 0 while the keys cover the sequence so far (a static cache's buffer) and the
    columns before the last ``keys`` under a sliding window; a query sees its own key unless it
    is padding. No host sync."""
    end = start + n
    if mask is None:
        return None, True
    if not isinstance(mask, torch.Tensor):
        return None, False
    if mask.dim() == 2:
        if mask.shape[1] < end:
            return None, False
        return mask[:, start:end].bool(), True
    if mask.dim() != 4 or mask.shape[-2] != n:
        return None, False
    width = mask.shape[-1]
    offset = 0 if width >= end else end - width
    if start - offset < 0:
        return None, False
    q = torch.arange(n, device=mask.device)
    diag = mask[:, 0, q, q + (start - offset)]
    return (diag if diag.dtype == torch.bool else diag == 0), True


def _max_length(cache: Any) -> int | None:
    """The width of a static cache's buffer (None: a cache without one, e.g. dynamic)."""
    for name in ("get_max_length", "get_max_cache_shape"):
        fn = getattr(cache, name, None)
        if callable(fn):
            try:
                got = fn()
            except (ValueError, TypeError, AttributeError, IndexError, NotImplementedError):
                continue
            if isinstance(got, int) and got > 0:
                return got
    return None


def _cache_length(cache: Any) -> int | None:
    """Tokens a Hugging Face cache holds (None: not a cache, or a recurrent state without one)."""
    fn = getattr(cache, "get_seq_length", None)
    if not callable(fn):
        return None
    try:
        n = int(fn())
    except (ValueError, TypeError, AttributeError, IndexError, NotImplementedError):
        return None  # a state-space model's cache: linear-attention layers have no length
    layers = getattr(cache, "layers", None)
    if n == 0 and isinstance(layers, (list, tuple)):
        # a hybrid cache that reads its length from layer 0, which holds no keys when it is a
        # linear-attention layer (MiniMax): the length of the layers that do
        for i in range(1, len(layers)):
            try:
                n = max(n, int(fn(i)))
            except (ValueError, TypeError, AttributeError, IndexError, NotImplementedError):
                continue
    return n


def _output_cache(output: Any) -> Any:
    """The cache a model call returned (``past_key_values``, or Mamba's ``cache_params``)."""
    for name in ("past_key_values", "cache_params"):
        try:
            cache = getattr(output, name, None)
        except Exception:  # an output type whose attributes raise: no cache read
            return None
        if cache is not None and not isinstance(cache, torch.Tensor):
            return cache
    return None


class TokenTracker:
    """Reads the token positions of every call of a model (see the module docstring).

    ``marks`` maps a layer name to a function giving how many calls of it were recorded so far;
    each step notes those counts, so that a layer's calls can be matched with the model calls.
    """

    def __init__(self, marks: dict[str, Any] | None = None) -> None:
        self.steps: list[_Step] = []
        self.marks = marks or {}
        self.prompt_end = 0  # the column where the current sequence's prompt ends
        self.current: _Step | None = None  # the model call under way (None between calls)
        self.encoder_decoder = False
        self._seq = 0
        self._cache: Any = None  # weak reference to the previous call's cache
        self._pending: torch.Tensor | None = None  # beam_idx of reorders since the last call
        self._wrapped: list[Any] = []  # caches whose reorder_cache is wrapped
        self.elsewhere: str | None = None  # a thread whose model calls the scope left alone
        self.called = False  # whether the scope's thread called the model
        # generate() under way in a thread: {thread id: the prompt's width, None once read}
        self._generating: dict[int, int | None] = {}
        self._prompt_step: _Step | None = None  # the current sequence's first call
        self._prompt_rows: torch.Tensor | None = None  # its rows after the reorders since
        self._generate_of: Any = None  # weak reference to the model whose generate is wrapped
        # {sequence: columns of the tokens that ran for what generate() returned (its width - 1)}
        self.returned: dict[int, int] = {}
        self._cropped: set[int] = set()  # sequences that ran candidates (see _pre)
        self.thread = get_ident()  # the thread whose calls it reads (its scope's)
        # the columns the first call seen started at, where it started past 0: tokens a cache
        # passed in held already, computed before the scope (nothing acted on them)
        self.unseen = 0
        self.unseen_prompt_end = 0  # the prompt's end then (what -k counts back from)
        # the last call read as a new sequence without anything saying so (no mask, cache or
        # cache_position): (its step, its argument objects and their tensors' fingerprints,
        # what it returned, the model's buffers and tensor attributes with their versions), so
        # that the next such call can tell whether state was carried from it (see _carried)
        self._state: tuple[Any, ...] | None = None
        self._root: Any = None  # weak reference to the model
        self._warned_held = False  # the warning of _carried about the model's own tensors
        # only the positions within each call are read (steer's negative positions): where a
        # call starts does not matter, nor whether it continues the one before
        self.within = False

    def attach(self, scope: HookScope, model: nn.Module, *, reorders: bool = True) -> None:
        """Add the pre-hook and post-hook to the root model; caches met in the calls get their
        ``reorder_cache`` wrapped until the scope is removed (``reorders`` is kept for callers:
        rows are always followed)."""
        root = strip_compiled(model)
        self._root = weakref.ref(root)
        cfg = getattr(root, "config", None)
        self.encoder_decoder = bool(getattr(cfg, "is_encoder_decoder", False))
        scope.add_forward_pre(root, _TrackerHook(self), layer="", with_kwargs=True)
        scope.add_forward(root, self._post, layer="")
        self._wrap_generate(root)
        scope.on_remove(self._unwrap)

    def clear(self) -> None:
        self.steps.clear()
        self.current = None
        self._pending = None
        self._cache = None
        self.prompt_end = 0
        self.elsewhere, self.called = None, False
        self._prompt_step, self._prompt_rows = None, None
        self.returned.clear()
        self._cropped.clear()
        self._state = None

    # -- hooks ----------------------------------------------------------------------------------
    def _inputs(self, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """``(token ids or embeddings, token ids or None, attention mask)`` of a call."""
        if self.encoder_decoder:
            ids = kwargs.get("decoder_input_ids")
            x = ids if isinstance(ids, torch.Tensor) else kwargs.get("decoder_inputs_embeds")
            return x, ids, kwargs.get("decoder_attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        return x, ids, kwargs.get("attention_mask")

    def _pre(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if in_backward():
            return
        self.called = True
        x, ids, mask = self._inputs(args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            self.current = None
            return
        batch, n = x.shape[0], x.shape[1]
        unmarked = False
        cache = kwargs.get("past_key_values")
        if cache is None:
            cache = kwargs.get("cache_params")
        length = _cache_length(cache)
        mask = _full_mask(mask)
        prev = self.steps[-1] if self.steps else None
        conflict = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            start = mask.shape[1] - n
            if length is not None and length < start and mask.shape[1] == _max_length(cache):
                start = length  # a static cache's buffer (Bloom pads its 2-D mask to it)
            elif length is not None and length != start:
                conflict = (
                    f"its attention mask is {mask.shape[1]} columns wide for {n} new tokens, but "
                    f"the KV cache held {length} tokens before it (a mask must cover the cached "
                    "and the new tokens, as generate() passes it)"
                )
        elif length is not None:
            start = length
        elif isinstance(kwargs.get("cache_position"), torch.Tensor):
            start = int(kwargs["cache_position"][0])
        elif cache is not None and prev is not None and self._same_cache(cache):
            start = prev.end  # a recurrent state (Mamba): the calls continue one another
        else:
            start = 0
            unmarked = True  # nothing says where its tokens sit: see _carried
            if cache is not None and prev is None and _state_tensors(cache):
                # a cache whose length cannot be read (a state-space model's DynamicCache of
                # linear-attention layers raises in get_seq_length), holding state from calls
                # made before the scope: its tokens may sit anywhere after 0
                conflict = (
                    f"it is given a {type(cache).__name__} that already holds state, whose "
                    "length cannot be read (get_seq_length gives none), and no attention mask, "
                    "cache_position or earlier call in the scope says where its "
                    f"{n} token(s) sit: its positions are not known; pass cache_position "
                    "(torch.arange(cached, cached + n)), or make the calls that filled the "
                    "cache inside the scope"
                )
        tokens = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        rerun = self._recompute(prev, batch, n, tokens, mask) if start == 0 else False
        new_seq = start == 0 and rerun is False
        before_scope = prev is None and start > 0 and not self.steps
        # generate()'s first call holds the prompt and, with prompt-lookup or assisted decoding,
        # the first candidates after it; given a cache that holds the prompt's first tokens, it
        # holds the others only: the prompt is the input_ids generate() was given
        width = self._generating.get(get_ident())
        if width is not None:
            self._generating[get_ident()] = None  # read once, by generate()'s first call
            if self.encoder_decoder or width <= 0 or (new_seq and width >= n):
                width = None
        first = new_seq or width is not None  # the first call of a prompt
        if new_seq:
            self._seq += 1
            self.prompt_end = n
        if width is not None:
            self.prompt_end = width
        # candidates (prompt-lookup, assisted decoding): a generate() call of several tokens
        # after the prompt, or a cache cropped between calls (candidates rejected)
        if (width is not None and width < n) or (
            prev is not None
            and prev.seq == self._seq
            and start > 0
            and (start < prev.end or (n > 1 and get_ident() in self._generating))
        ):
            self._cropped.add(self._seq)
        step = _Step(start, n, batch, self._seq)
        step.device = x.device
        step.tokens = tokens.detach().clone() if tokens is not None else None
        step.marks = {name: count() for name, count in self.marks.items()}
        pending, self._pending = self._pending, None
        if isinstance(rerun, torch.Tensor):  # a re-run whose rows beam search reordered
            pending = rerun if pending is None else pending.to(rerun.device)[rerun]
        if (
            pending is not None
            and prev is not None
            and (start > 0 or isinstance(rerun, torch.Tensor))
            and pending.numel() == batch
        ):
            step.perm = pending
            rows = self._prompt_rows
            self._prompt_rows = pending if rows is None else rows.to(pending.device)[pending]
        if first:
            self._prompt_step, self._prompt_rows = step, None
        if before_scope:
            self.unseen = max(self.unseen, start)
            self.unseen_prompt_end = self.prompt_end
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= step.end:
            step.mask2d = mask  # read when needed: generate passes a new mask each call
            step._before = None if start else 0
        else:
            step._before = self._before(step, prev)
            own, readable = _own_real(mask, start, n)
            if not readable:
                own, why = None, self._unreadable(kwargs.get("position_ids"), step, mask)
                conflict = conflict or why
            step._own = own
        step.conflict = conflict
        state, self._state = self._state, None
        if unmarked and not self.within:
            if new_seq and state is not None and state[0] is prev:
                step.carried = self._carried(state, args, kwargs, n)
            self._state = (step, *self._snapshot(args, kwargs))
        self._remember(cache)
        self.steps.append(step)
        self.current = step

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        state = self._state
        if state is not None and state[0] is self.current and get_ident() == self.thread:
            # what the call returned: an object the next call is given continues this one
            self._state = (*state[:2], _carriers(output), state[3])
        if self.current is not None and get_ident() == self.thread:
            # the cache the model made for a call given none (a state-space model's first
            # call): the next call given that object continues this one
            cache = _output_cache(output)
            if cache is not None and not self._same_cache(cache):
                self._remember(cache)
        self.current = None

    def _snapshot(self, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """What a call read as a new sequence is given and holds, to compare with the next such
        call (:meth:`_carried`): its argument objects with their tensors' fingerprints, nothing
        returned yet, the model's buffers and tensor attributes with their versions."""
        given = [(v, _fingerprint(v)) for v in _carriers([*args, *kwargs.values()])]
        root = self._root() if self._root is not None else None
        held: list[tuple[str, str, torch.Tensor, int]] = []
        if root is not None:
            for name, m in root.named_modules():
                for k, t in itertools.chain(
                    m._buffers.items(),
                    ((k, v) for k, v in m.__dict__.items() if v.__class__ is torch.Tensor),
                ):
                    if t is not None and not t.is_inference():
                        held.append((name, k, t, t._version))
        return given, [], held

    def _carried(
        self, state: tuple[Any, ...], args: Any, kwargs: dict[str, Any], n: int
    ) -> str | None:
        """Why a call read as a new sequence (nothing says where its tokens sit) continues the
        call before, ``None`` when nothing shows it: it is given an object that call returned or
        changed and that holds tensors (a hand-written KV cache: a dict, a list, an object of the
        model's own). Where instead that call changed the model's own buffers or tensor
        attributes in place (a cache the modules keep, as Meta's reference Llama does: a new
        prompt at 0 and a decoding step look alike), a warning says so, once."""
        _, given, returned, held = state
        what = None
        for v in _carriers([*args, *kwargs.values()]):
            if not _state_tensors(v):
                continue
            if any(v is r for r in returned):
                what = f"a {type(v).__name__} the call before returned"
                break
            if any(g is v and _fingerprint(v) != fp for g, fp in given):
                what = f"a {type(v).__name__} given to the call before, which changed it"
                break
        fix = (
            "pass an attention_mask covering the cached and the new tokens, cache_position, or "
            "a Hugging Face Cache as past_key_values (steer's positions='all' and negative "
            "positions count within each call)"
        )
        if what is not None:
            return (
                f"it reads as the start of a new sequence (no attention mask, Hugging Face cache "
                f"or cache_position says where its {n} token(s) sit), yet it is given {what}, as "
                "a hand-written KV cache carries the tokens before it: its positions are not "
                f"known; {fix}"
            )
        moved = [f"{m}.{k}" if m else k for m, k, t, version in held if t._version != version]
        if moved and not self._warned_held:
            self._warned_held = True
            shown = ", ".join(moved[:3]) + (" ..." if len(moved) > 3 else "")
            warnings.warn(
                f"hookscope: model call {len(self.steps)} ({n} token(s)) is read as a new "
                "sequence starting at position 0 (no attention mask, Hugging Face cache or "
                f"cache_position says where its tokens sit), but the call before changed the "
                f"model's own tensors in place ({shown}), as a KV cache the modules keep does: "
                "if the call continues the one before, its positions (and steer's positions "
                f"from the start, 'prompt', 'generated') are off by the tokens before it; {fix}",
                HookscopeWarning,
                stacklevel=4,
            )
        return None

    def _before(self, step: _Step, prev: _Step | None) -> Any:
        """Real tokens in the columns before a call without a 2-D mask, per row."""
        if step.start == 0:
            return 0
        if prev is not None and prev.seq == step.seq and prev.end == step.start:
            count = prev.count()
            if isinstance(count, torch.Tensor) and step.perm is not None:
                count = count[step.perm.to(count.device)]
            return count
        if prev is not None and prev.seq == step.seq:
            real = _real_columns(
                [s for s in self.steps if s.seq == step.seq], step.batch, step.start
            )
            if real is not None:
                return real.sum(1)
        return step.start  # a cache filled before the scope opened: taken as real tokens

    def _unreadable(self, pos: Any, step: _Step, mask: Any) -> str | None:
        """A mask hookscope cannot read: every token is real if ``position_ids`` say so."""
        if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape == (step.batch, step.n):
            before = step.before
            if isinstance(before, torch.Tensor):
                before = before.to(pos.device)[:, None]
            want = torch.arange(step.n, device=pos.device) + before
            if bool((pos == want).all()):
                return None
        return (
            f"its attention mask ({type(mask).__name__}) does not say which tokens are padding "
            "and its position_ids do not show that none are; pass a 2-D attention_mask, or "
            "generate without padding"
        )

    def _same_cache(self, cache: Any) -> bool:
        ref = self._cache
        return ref is not None and ref() is cache

    def _remember(self, cache: Any) -> None:
        if cache is None:
            self._cache = None
            return
        try:
            self._cache = weakref.ref(cache)
        except TypeError:
            self._cache = None
        self._wrap(cache)

    def _wrap(self, cache: Any) -> None:
        """Wrap ``cache.reorder_cache`` (on the instance) to learn beam search's ``beam_idx``;
        every tracker open on the cache (a capture and a steer) is told."""
        if not callable(getattr(cache, "reorder_cache", None)):
            return
        if any(c is cache for c in self._wrapped):
            return
        present = getattr(cache, "__dict__", {}).get("reorder_cache")
        if present is not None and not isinstance(present, _Reorder):
            return  # set by its owner: leave it
        if present is None:
            present = _Reorder(cache.reorder_cache)
            cache.reorder_cache = present
        present.trackers.append(weakref.ref(self))
        self._wrapped.append(cache)

    def _unwrap(self) -> None:
        for cache in self._wrapped:
            present = cache.__dict__.get("reorder_cache")
            if isinstance(present, _Reorder):
                present.trackers = [t for t in present.trackers if t() not in (self, None)]
                if not present.trackers:
                    del cache.__dict__["reorder_cache"]
        self._wrapped.clear()
        self._unwrap_generate()
        self.current = None
        self._state = None  # (what the last call was given and returned: not kept past the scope)

    def _reordered(self, idx: torch.Tensor) -> None:
        self._pending = idx if self._pending is None else self._pending.to(idx.device)[idx]

    def _recompute(
        self, prev: _Step | None, batch: int, n: int, tokens: Any, mask: Any
    ) -> bool | torch.Tensor:
        """A call from column 0 that re-runs the current sequence (``use_cache=False``): True,
        or, where beam search reordered the rows since (without a cache nothing tells it how),
        ``rows`` with row ``r`` of the call continuing row ``rows[r]`` of the previous one (rows
        whose tokens and padding are the same are alike: the first is taken); else False."""
        if prev is None or prev.batch != batch or n <= prev.end - 1 or tokens is None:
            return False
        known = _tokens_upto(self.steps, prev.seq, prev.end)
        if known is None:
            return False
        width = known.shape[1]
        new = tokens[:, :width].to(known.device)
        if torch.equal(new, known):
            return True
        # beam search without a cache: each row must continue some row of the previous call,
        # its padding too where both calls have a 2-D mask
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and prev.mask2d is not None:
            pad = prev.mask2d[:, :width].to(known.device) == 0
            known = known.masked_fill(pad, -1)
            new = new.masked_fill(mask[:, :width].to(known.device) == 0, -1)
        same = (new[:, None] == known[None]).all(-1)  # [call's rows, previous rows]
        if not bool(same.any(1).all()):
            return False
        return same.int().argmax(1)

    # -- per call (steering) --------------------------------------------------------------------
    def positions(
        self, within: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any] | None:
        """``(position ids [batch, n], real [batch, n] or None, real tokens up to the call's end
        per row)`` of the current call; raises when the call cannot be placed exactly.
        ``within``: only the positions within the call are read (steer's negative positions):
        a call that may continue the one before (:attr:`_Step.carried`) is not refused."""
        step = self.current
        if step is None:
            return None
        if step.conflict is not None:
            raise SequenceError(f"model call {len(self.steps) - 1}: {step.conflict}")
        if step.carried is not None and not within:
            raise SequenceError(f"model call {len(self.steps) - 1}: {step.carried}")
        before = step.before
        if isinstance(before, torch.Tensor):
            before = before.to(step.device)[:, None]
        if step.own is None:
            pos = torch.arange(step.start, step.end, device=step.device) - step.start + before
            pos = pos.expand(step.batch, step.n) if pos.dim() == 1 else pos
        else:
            pos = step.own.to(step.device).long().cumsum(1) - 1 + before
        total = step.count()
        return pos, step.own, total

    def prompt_tokens(self) -> Any:
        """Real tokens of the current sequence's prompt per row (int or ``[batch]``) while
        ``generate()`` runs in this thread, else ``None`` (a plain forward, a hand loop)."""
        first = self._prompt_step
        if get_ident() not in self._generating or first is None or self.current is None:
            return None
        if self.current.seq != first.seq:
            return None
        own = first.own
        if own is None:
            return first.before + min(self.prompt_end, first.end) - first.start
        count = own[:, : max(0, self.prompt_end - first.start)].sum(1) + first.before
        rows = self._prompt_rows
        return count if rows is None else count.to(rows.device)[rows]

    # -- generate(): the prompt's width -----------------------------------------------------------
    def _returned(self, width: int) -> None:
        """``generate()`` returned ``width`` columns: the last one never ran (prompt-lookup and
        assisted decoding may have run candidates past it)."""
        seq = self.steps[-1].seq if self.steps else None
        # only where candidates ran (a cropped cache): beam search returns finished beams that
        # may be shorter than the rows its last step ran, which the sequence follows
        if seq in self._cropped and not self.encoder_decoder:
            self.returned[seq] = width - 1

    def _wrap_generate(self, root: nn.Module) -> None:
        """Wrap ``root.generate`` (on the instance) while the scope is open, to learn the width
        of the prompt it is given; every tracker open on the model is told."""
        if not callable(getattr(type(root), "generate", None)):
            return
        present = root.__dict__.get("generate")
        if (
            isinstance(present, types.MethodType)
            and present.__self__ is root
            and present.__func__ is type(root).generate
        ):
            present = None  # the class's own method (a deep copy or a pickle of a wrapped model)
        if present is not None and not isinstance(present, _Generate):
            return  # set by its owner: leave it
        if present is None:
            present = _Generate(root)
            root.__dict__["generate"] = present
        present.trackers.append(weakref.ref(self))
        self._generate_of = weakref.ref(root)

    def _unwrap_generate(self) -> None:
        ref = self._generate_of
        root = ref() if ref is not None else None
        if root is None:
            return
        present = root.__dict__.get("generate")
        if isinstance(present, _Generate):
            present.trackers = [t for t in present.trackers if t() not in (self, None)]
            if not present.trackers:
                del root.__dict__["generate"]
        self._generate_of = None


def _carriers(value: Any) -> list[Any]:
    """The objects in a call's output that may carry state to the next call: the output itself,
    or the items of its tuple or list, or the values of its mapping (a ``ModelOutput``), that
    are neither tensors nor plain values (a dict, a list, an object)."""
    if isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        items = [value]
    return [
        v
        for v in items
        if v.__class__ not in SCALARS
        and not isinstance(v, (torch.Tensor, nn.Module, type))
        and not callable(v)
    ]


def _state_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors an argument object holds (nested containers, and inside objects)."""
    return tensors_of(obj) + hidden_tensors(obj, depth=6)[0]


def _fingerprint(obj: Any) -> tuple[Any, ...]:
    """What an argument object holds, to see it changed: its tensors (identity, version,
    shape), and its length where it has one (a list of per-layer caches appended to)."""
    try:
        size = len(obj)
    except Exception:  # an object without a length
        size = None
    return size, tuple((id(t), t._version, tuple(t.shape)) for t in _state_tensors(obj))


class _TrackerHook(_Hook):
    """The tracker's pre-hook: reads the scope's thread's calls, and notes the name of a thread
    whose calls it leaves alone (see :func:`~hookscope.core._scope.acts_here`)."""

    __slots__ = ("tracker",)

    def __init__(self, tracker: TokenTracker) -> None:
        self.fn = None  # type: ignore[assignment]
        self.tracker = tracker  # _Hook's other fields are set by HookScope when it is registered

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            if self.tracker.elsewhere is None:
                self.tracker.elsewhere = threading.current_thread().name
            return None
        if quiet(self.scope_id):  # a product's own run of the model
            return None
        return self.tracker._pre(module, args, kwargs)


_THREADS = (
    "a scope acts only on the calls of the thread that created it (docs/guide/core.md, Threads)"
)


class _Reorder:
    """A cache's ``reorder_cache`` while trackers are open on it: tells them each ``beam_idx``."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.trackers: list[Any] = []

    def __call__(self, beam_idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        idx = beam_idx.detach()
        for ref in self.trackers:
            tracker = ref()
            if tracker is not None:
                tracker._reordered(idx)
        return self.method(beam_idx, *args, **kwargs)


class _Generate:
    """A model's ``generate`` while trackers are open on it: tells them, for the thread that
    calls it, the width of the prompt (``input_ids``/``inputs_embeds``) until it returns. A deep
    copy or a pickle of the model gets the class's own method (the copy holds no scope)."""

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)
        self.trackers: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        root = self._root()
        assert root is not None
        x = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        ids = isinstance(x, torch.Tensor) and not x.is_floating_point()
        if not isinstance(x, torch.Tensor):
            x = kwargs.get("inputs_embeds")
        width = int(x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
        ident = get_ident()
        # the trackers of scopes opened in this thread (a scope acts on its own thread's calls)
        told = [t for t in (ref() for ref in self.trackers) if t is not None and t.thread == ident]
        for t in told:
            t._generating[ident] = width
        try:
            out = type(root).generate(root, *args, **kwargs)
        finally:
            for t in told:
                t._generating.pop(ident, None)
        seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        # (given token ids, generate() returns the prompt and the new tokens; given only
        # embeddings, the new tokens only)
        if ids and isinstance(seqs, torch.Tensor) and seqs.dim() == 2:
            for t in told:
                t._returned(seqs.shape[1])
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        twin = memo.get(id(self._root()))
        if twin is None:
            return self
        return types.MethodType(type(twin).generate, twin)

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (self._root(), "generate"))


def _real_columns(steps: list[_Step], batch: int, width: int) -> torch.Tensor | None:
    """``[batch, width]`` real columns from the steps (later calls win; None: a gap)."""
    if not steps:
        return None
    dev = steps[-1].device
    real = torch.ones(batch, width, dtype=torch.bool, device=dev)
    seen = torch.zeros(width, dtype=torch.bool)
    for s in steps:
        if s.batch != batch:
            return None
        lo, hi = min(s.start, width), min(s.end, width)
        if s.own is not None:
            real[:, lo:hi] = s.own[:, : hi - lo].to(dev)
        else:
            real[:, lo:hi] = True
        seen[lo:hi] = True
    return real if bool(seen.all()) else None


def _tokens_upto(steps: list[_Step], seq: int, end: int) -> torch.Tensor | None:
    out: torch.Tensor | None = None
    for s in steps:
        if s.seq != seq or s.tokens is None:
            continue
        if out is None:
            out = torch.full((s.batch, end), -1, dtype=s.tokens.dtype, device=s.tokens.device)
        out[:, s.start : s.end] = s.tokens[:, : max(0, min(s.end, end) - s.start)]
    return out


def assemble(tracker: TokenTracker, name: str, outputs: list[Any]) -> TokenSequence:
    """Put the recorded calls of layer ``name`` (``outputs``, in order) into one sequence."""
    for i, step in enumerate(tracker.steps):
        why = step.conflict or step.carried
        if why is not None:
            raise SequenceError(
                f"sequence({name!r}): model call {i} cannot be placed in the sequence: {why}"
            )
    seqs = sorted({s.seq for s in tracker.steps})
    if not seqs:
        fix = "open the capture inside the function the thread runs"
        if tracker.elsewhere is not None and not tracker.called:
            raise SequenceError(
                f"sequence({name!r}): the model was called only from another thread "
                f"({tracker.elsewhere!r}) while the capture was open, and {_THREADS}: {fix}"
            )
        raise SequenceError(
            f"sequence({name!r}): the model was never called with token inputs ("
            + ("decoder_input_ids" if tracker.encoder_decoder else "input_ids or inputs_embeds")
            + ") while the capture was open"
            + (
                f"; its calls from thread {tracker.elsewhere!r} were left alone: {_THREADS}: {fix}"
                if tracker.elsewhere is not None
                else ""
            )
        )
    if len(seqs) > 1:
        raise SequenceError(
            f"sequence({name!r}): the capture saw {len(seqs)} separate sequences (e.g. two "
            "generate() calls); open one capture per sequence, or call cap.clear() between them"
        )
    steps = tracker.steps
    if steps[0].start > 0:
        raise SequenceError(
            f"sequence({name!r}): the first model call starts at token {steps[0].start} (its "
            "cache already held the earlier tokens when the capture opened); open the capture "
            "before the first call of the sequence"
        )
    counts = [*(s.marks.get(name, 0) for s in steps), len(outputs)]
    enc = (
        f" ({name!r} looks like a layer of the encoder: on an encoder-decoder model sequence() "
        "follows the decoder's tokens; read the encoder's values with cap.calls(layer))"
        if tracker.encoder_decoder
        else ""
    )
    if counts[0] > 0 and counts[-1] == counts[0]:
        raise SequenceError(
            f"sequence({name!r}): layer {name!r} ran {counts[0]} times outside the model's "
            "calls and never during them"
            + (
                enc
                or "; sequence() aligns what runs inside the calls of the model given to capture"
            )
        )
    parts: list[torch.Tensor] = []
    for i, step in enumerate(steps):
        k = counts[i + 1] - counts[i]
        if k != 1:
            why = (
                "it did not run. A compiled forward that hookscope was not given ignores hooks: "
                "transformers' generate() compiles the forward by itself for a static cache on a "
                "GPU (pass disable_compile=True to generate), and so does model.forward = "
                "torch.compile(model.forward); compile with model.compile() or "
                f"torch.compile(model) instead, which hookscope routes; and {_THREADS}: a "
                "layer that the forward runs in a thread of its own is not seen"
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
                "outputs shaped [batch, tokens, ...]" + enc
            )
        parts.append(t)
    end = tracker.returned.get(steps[-1].seq)
    return _build(steps, parts, end)


def _build(steps: list[_Step], parts: list[torch.Tensor], end: int | None = None) -> TokenSequence:
    """The sequence from each call's values; ``end``: the columns of the tokens that ran for
    what ``generate()`` returned (candidates it ran past them are left out)."""
    last = steps[-1]
    batch, width = last.batch, max(s.end for s in steps)
    ref = parts[-1]
    device = ref.device
    for part in parts:
        if part.shape[0] != batch:
            raise SequenceError(
                f"the batch changed from {part.shape[0]} to {batch} rows between model calls; "
                "sequence() needs the same rows throughout"
            )
    reordered = any(s.perm is not None for s in steps)
    contiguous = all(a.start + a.n == b.start for a, b in itertools.pairwise(steps))
    if contiguous and not reordered:  # the common case: one cat
        values = torch.cat([p.to(device) for p in parts], 1)
        toks = [s.tokens for s in steps]
        tokens = (
            None if any(t is None for t in toks) else torch.cat([t.to(device) for t in toks], 1)
        )
        if last.mask2d is not None and last.end == width:  # generate: its last mask says it all
            return _realign(values, last.mask2d[:, :width].bool().to(device), tokens, end)
    # the rows each step's row r became at the end (beam search reorders rows between calls)
    rowmaps: list[torch.Tensor] = [torch.arange(batch, device=device)] * len(steps)
    for i in range(len(steps) - 1, 0, -1):
        perm = steps[i].perm
        rowmaps[i - 1] = rowmaps[i] if perm is None else perm.to(device)[rowmaps[i]]
    if not contiguous or reordered:
        values, tokens = _scatter(steps, parts, rowmaps, batch, width, ref)
    real = torch.ones(batch, width, dtype=torch.bool, device=device)
    if any(s.own is not None for s in steps):  # else no padding: every column is real
        for step, rows in zip(steps, rowmaps):  # later calls win (use_cache=False re-runs)
            own = step.own
            real[:, step.start : step.end] = True if own is None else own.to(device)[rows]
    return _realign(values, real, tokens, end)


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
    values: torch.Tensor, real: torch.Tensor, tokens: torch.Tensor | None, end: int | None = None
) -> TokenSequence:
    """Move each row's real tokens to the front: column = position (real tokens before it);
    the columns from ``end`` on are left out."""
    if end is not None and end < values.shape[1]:
        values, real = values[:, :end], real[:, :end]
        tokens = None if tokens is None else tokens[:, :end]
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
