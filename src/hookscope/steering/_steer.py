"""``steer``: add a vector to (or project a direction out of) layer outputs at chosen positions."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn as nn

from ..core._compiled import strip_compiled
from ..core._errors import HookscopeError, HookscopeWarning, some_names
from ..core._nested import replace_first
from ..core._recompute import Replays
from ..core._scope import (
    HookScope,
    _Hook,
    acts_here,
    check_model,
    get_ident,
    thread_checked,
    warn_elsewhere,
    warn_lost,
)
from ..core._select import Selector, find
from ..core._sequence import SequenceError, TokenTracker

__all__ = ["Steering", "steer"]

_THREAD_RULE = (
    "a scope acts only on the calls of the thread that created it (docs/guide/core.md, "
    "Threads): open the scope inside the function the thread runs"
)
_NEVER_RAN = (
    "it was never called through module(...) in the thread that opened the scope (a parent "
    "that calls child.forward(...) directly skips hooks, a branch not taken does not run, and a "
    "compiled graph hookscope was not given ignores them: give hookscope the object you call); "
    + _THREAD_RULE
)

Positions = Literal["all", "prompt", "generated"] | int | torch.Tensor
_NAMED = ("all", "prompt", "generated")


class Steering(HookScope):
    """The scope :func:`steer` returns: removes its hooks on exit, like every hookscope scope.

    On a clean exit it warns when a steered layer never ran in the scope's thread (the model
    was not called inside the ``with`` block, or ``generate`` ran in another thread: a scope acts
    only on the calls of the thread that created it), and when the steered layers ran but no
    position was ever selected (``positions="generated"`` around a plain forward, ``"prompt"``
    after the prompt only).
    """

    def __init__(self) -> None:
        super().__init__("steer")
        self.ran = 0  # calls of steered layers
        self.steered = 0  # calls in which every position was steered (positions say so)
        self.chosen: torch.Tensor | None = None  # whether a per-token selection chose a token
        self.positions: Any = "all"
        self.layers: list[str] = []
        self._failed = False
        self._exiting = False  # removed by the with block's exit (for the warnings' stacklevel)
        self.model_calls = 0
        self.hooks: list[_SteerHook] = []
        self.tracker: TokenTracker | None = None
        self._seen: list[int] = []
        self._skipped: set[str] = set()
        self.replays = Replays(self, "steer")  # exact under activation checkpointing

    def _on_model_call(self, module: nn.Module, args: Any) -> None:
        """Before each model call: did every steered layer run during the previous one?"""
        self._check_ran()
        self.model_calls += 1
        self._seen = [h.count for h in self.hooks]

    def _check_ran(self, stacklevel: int = 3) -> None:
        if not self.model_calls or not self._seen:
            return
        missed = [h for h, c in zip(self.hooks, self._seen) if h.count == c]
        # (a layer replaced in the model, or whose hook hs.remove_hooks took: said at exit)
        new = [h for h in missed if h.name not in self._skipped and not self._lost(h.name)]
        if new:
            self._skipped.update(h.name for h in new)
            away = next((h for h in new if h.elsewhere), None)
            warnings.warn(
                f"steer: layers {some_names([h.name for h in new])} did not run during model "
                f"call {self.model_calls - 1}, so that call was not steered. "
                + (
                    f"{away.name!r} ran in thread {away.elsewhere!r}, and a scope acts only on "
                    "the calls of the thread that created it (docs/guide/core.md, Threads): "
                    "steer a layer that the model calls in this thread, or open the scope in "
                    "the thread that calls the layer. "
                    if away is not None
                    else ""
                )
                + "A compiled forward that "
                "hookscope was not given ignores hooks: transformers' generate() compiles the "
                "forward by itself for a static cache on a GPU (pass disable_compile=True to "
                "generate), and so does model.forward = torch.compile(model.forward); compile "
                "with model.compile() or torch.compile(model) instead, which hookscope routes",
                HookscopeWarning,
                stacklevel=stacklevel,
            )

    def _lost(self, name: str) -> bool:
        """Whether the hook of ``name`` stopped acting: the model holds another module there
        now, or ``hs.remove_hooks`` took it (:func:`warn_lost` says so at exit)."""
        return name in self.stripped or self.replaced(name) is not None

    def _check_never(self, stacklevel: int) -> None:
        """At exit: warn for the steered layers that never ran in the scope's thread."""
        never = [h for h in self.hooks if not h.count and h.name not in self._skipped]
        if not never:
            return
        self._skipped.update(h.name for h in never)
        away = [h for h in never if h.elsewhere]
        if away:
            h = away[0]
            warnings.warn(
                f"steer: layer(s) {some_names([h.name for h in away])} never ran in the thread "
                "that opened the scope, so nothing was steered: their "
                f"{sum(a.elsewhere_calls for a in away)} calls from thread {h.elsewhere!r} were "
                "left alone (as generate() in a background thread, TextIteratorStreamer's "
                f"recipe); {_THREAD_RULE}",
                HookscopeWarning,
                stacklevel=stacklevel,
            )
        rest = [h.name for h in never if not h.elsewhere]
        if rest:
            warnings.warn(
                f"steer: layer(s) {some_names(rest)} never ran while the scope was open, so "
                f"nothing was steered there: {_NEVER_RAN}",
                HookscopeWarning,
                stacklevel=stacklevel,
            )

    def _check_unseen(self, stacklevel: int) -> None:
        """At exit: warn where the positions choose tokens the model computed before the scope
        opened (a cache passed in that already held them): nothing steered those."""
        tracker = self.tracker
        n = tracker.unseen if tracker is not None else 0
        if not n:
            return
        p = self.positions
        if isinstance(p, str):
            hit = p == "prompt"
        elif isinstance(p, int):
            # -k in generate(): the prompt's last k tokens (outside it, each call's own last k)
            end = tracker.unseen_prompt_end  # (past n only in generate())
            hit = p < n if p >= 0 else end > n and end + p < n
        else:
            hit = bool(p[..., :n].any())
        if hit:
            warnings.warn(
                f"steer(positions={_show(p)}): the positions choose some of the first {n} "
                "tokens, which the model computed before the scope opened (the cache passed to "
                "the model already held them), so they were not steered and the cache keeps "
                "their unsteered values; open the scope before filling the cache, or pass the "
                "whole prompt without it",
                HookscopeWarning,
                stacklevel=stacklevel,
            )

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._failed = exc is not None
        self._exiting = True
        return super().__exit__(exc_type, exc, tb)

    def remove(self) -> None:
        check = self.active and not self._failed
        up = (
            4 if self._exiting else 2
        )  # the warnings' frame: the with statement, or remove()'s caller
        super().remove()
        if check:
            counts = {h.name: h.count for h in self.hooks}
            self._skipped.update(
                warn_lost(self, self.layers, "steer", "steered", counts, up + 1, threads=False)
            )
            self._check_ran(up + 1)
            self._check_never(up + 1)
            # (a layer that never ran here is said above; one that ran in both threads here)
            ran_here = [n for n in self.layers if counts.get(n) and n not in self._skipped]
            warn_elsewhere(self, ran_here, "steer", "steered", counts, up + 1)
            self._check_unseen(up + 1)
        # one host sync at exit: did a per-token selection choose any token?
        chosen = self.chosen is not None and bool(self.chosen)
        if check and self.ran and not self.steered and not chosen:
            warnings.warn(
                f"steer(positions={_show(self.positions)}): layers {some_names(self.layers)} ran "
                f"{self.ran} times but no position was steered ({_why_none(self.positions)})",
                HookscopeWarning,
                stacklevel=up,
            )

    close = remove


def _first(output: Any, name: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise HookscopeError(
        f"steer: layer {name!r} returned {type(output).__name__}, not a tensor or a tuple whose "
        "first item is the hidden-state tensor; steer the layer that returns the hidden states "
        "(e.g. the decoder block, or its attention/MLP submodule)"
    )


class _SteerHook(_Hook):
    """Forward hook adding ``scale * vector`` (or removing ``scale`` times the projection on it)."""

    __slots__ = (
        "_cache",
        "count",
        "elsewhere",
        "elsewhere_calls",
        "mode",
        "name",
        "scale",
        "scope_",
        "select",
        "vector",
    )

    def __init__(
        self,
        name: str,
        vector: torch.Tensor,
        scale: float,
        mode: str,
        select: Callable[[], Any],
        scope: Steering,
    ) -> None:
        self.fn = None  # type: ignore[assignment]
        self.name, self.vector, self.scale, self.mode = name, vector, scale, mode
        self.select, self.scope_ = select, scope
        self._cache: tuple[torch.device, torch.dtype, torch.Tensor] | None = None
        self.count = 0  # calls steered (or looked at) in the scope's thread
        self.elsewhere: str | None = None  # the name of a thread whose calls were left alone
        self.elsewhere_calls = 0

    def _delta(self, h: torch.Tensor) -> torch.Tensor:
        c = self._cache
        if c is not None and c[0] == h.device and c[1] == h.dtype:
            return c[2]
        v = self.vector
        if v.shape != (h.shape[-1],):
            raise HookscopeError(
                f"steer: the vector for layer {self.name!r} has shape {tuple(v.shape)}, but the "
                f"layer's hidden states have {h.shape[-1]} features (shape {tuple(h.shape)}); "
                f"give a vector of shape ({h.shape[-1]},)"
            )
        # in float32 (or the output's wider dtype), as steering-vectors and a float32 reference
        # do: a bf16/fp16 output gets the float32 result rounded once (the vector rounded to
        # bf16 first, then scaled and added, was up to 2 bf16 steps off); the unit vector is
        # made in float32 too (an fp16 norm above 65504 was inf: the direction became 0, and
        # nothing was ablated)
        v = v.detach().to(device=h.device, dtype=torch.promote_types(h.dtype, torch.float32))
        if self.mode == "add":
            d = self.scale * v
        else:
            norm = v.norm()
            if not 0.0 < float(norm) < math.inf:
                raise HookscopeError(
                    f"steer(mode='ablate'): the direction for layer {self.name!r} has norm "
                    f"{float(norm)} in {v.dtype}; give a nonzero direction of finite norm"
                )
            d = v / norm
        self._cache = (h.device, h.dtype, d)
        return d

    @thread_checked
    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if get_ident() != self.thread and not acts_here(self.thread, self.kind, self, module):
            self._away()  # another thread's call: left alone (see acts_here)
            return None
        replays = self.scope_.replays
        if not replays.acts(self.name):
            return None  # a recompute (activation checkpointing) of a call not steered
        h = _first(output, self.name)
        self.count += 1
        scope = self.scope_
        scope.ran += 1
        sel = self.select()
        if sel is False:
            return None
        if sel is None:
            scope.steered += 1
        else:  # on the device, read once at exit (no host sync per call)
            got = sel.any()
            scope.chosen = got if scope.chosen is None else scope.chosen | got.to(scope.chosen)
        d = self._delta(h)  # (float32 for a bf16/fp16 output: the sum is rounded once)
        if sel is not None and (h.dim() < 2 or sel.shape != h.shape[:2]):
            raise HookscopeError(
                f"steer: layer {self.name!r} output has shape {tuple(h.shape)}, but the model "
                f"call has {tuple(sel.shape)} (batch, tokens); positions other than 'all' need "
                "outputs shaped [batch, tokens, features]"
            )
        if self.mode == "add":
            if sel is None:
                new = h + d
            else:
                new = torch.addcmul(h, sel.unsqueeze(-1).to(device=h.device, dtype=d.dtype), d)
        else:  # h - scale * (h . u) u
            coef = (h if h.dtype == d.dtype else h.to(d.dtype)) @ d
            coef = coef.unsqueeze(-1) * (-self.scale)
            if sel is not None:
                coef = coef * sel.unsqueeze(-1).to(device=h.device, dtype=d.dtype)
            new = torch.addcmul(h, coef, d)
        if new.dtype != h.dtype:
            new = new.to(h.dtype)
        replays.acted_on(self.name, module, new)
        return replace_first(output, new)

    def _away(self) -> None:
        self.elsewhere_calls += 1
        if self.elsewhere is None:
            self.elsewhere = threading.current_thread().name


def _no_tokens(positions: Any, tracker: TokenTracker) -> HookscopeError:
    if tracker.encoder_decoder:
        return HookscopeError(
            f"steer(positions={positions!r}): a steered layer ran outside a decoder call of the "
            "encoder-decoder model (its encoder, which generate() runs once over the source, or "
            "a call without decoder_input_ids); positions count the decoder's tokens: steer "
            "encoder layers with positions='all'"
        )
    return HookscopeError(
        f"steer(positions={positions!r}) needs token inputs: the model was called without "
        "input_ids or inputs_embeds (or the layer ran outside a call of the model given to steer)"
    )


def _selector(positions: Any, tracker: TokenTracker | None) -> Callable[[], Any]:
    """``select()`` for the current model call: None (every position), False (none) or a bool
    tensor ``[batch, tokens]``."""
    if tracker is None:
        return lambda: None

    def named() -> Any:
        step = tracker.current
        if step is None:
            raise _no_tokens(positions, tracker)
        if step.carried is not None:
            raise HookscopeError(
                f"steer(positions={_show(positions)}): model call {len(tracker.steps) - 1}: "
                f"{step.carried}"
            )
        end = tracker.prompt_end
        if step.end <= end:  # prompt tokens only
            if positions != "prompt":
                return False
            # the prompt's real tokens, not its padding: a linear-attention layer (MiniMax)
            # carries what a padding slot holds into its state, so later tokens would see it
            own = step.own
            return None if own is None else own.to(_dev(step))
        if step.start >= end:
            return False if positions == "prompt" else None
        cols = torch.arange(step.start, step.end, device=_dev(step))
        sel = ((cols < end) if positions == "prompt" else (cols >= end)).expand(step.batch, step.n)
        own = step.own if positions == "prompt" else None
        return sel if own is None else sel & own.to(sel.device)

    def current(within: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        try:
            got = tracker.positions(within)
        except SequenceError as e:
            raise HookscopeError(f"steer(positions={_show(positions)}): {e}") from None
        if got is None:
            raise _no_tokens(_show(positions), tracker)
        return got

    def from_k() -> Any:
        pos, real, total = current(within=positions < 0)
        if positions >= 0:
            sel = pos >= positions
        else:  # the last -positions tokens of each row so far
            # in generate(): the prompt's last -positions tokens, then every generated token,
            # whatever the calls hold (one new token with the cache; the whole sequence again
            # without it; the prompt with candidates in prompt-lookup or assisted decoding)
            prompt = tracker.prompt_tokens()
            if prompt is not None:
                total = prompt
            if isinstance(total, torch.Tensor):
                total = total.to(pos.device)[:, None]
            sel = pos >= total + positions
        return sel if real is None else sel & real.to(sel.device)

    def from_mask() -> Any:
        pos, real, _ = current()
        m = positions if positions.dim() == 2 else positions.expand(pos.shape[0], -1)
        if m.shape[0] != pos.shape[0]:
            raise HookscopeError(
                f"steer: the positions mask has {m.shape[0]} rows but the model was called on "
                f"{pos.shape[0]} rows (beam search and num_return_sequences multiply the rows)"
            )
        m = m.to(pos.device)
        width = m.shape[1]
        inside = (pos >= 0) & (pos < width)
        sel = m.gather(1, pos.clamp(0, width - 1)) & inside
        return sel if real is None else sel & real.to(sel.device)

    if isinstance(positions, str):
        return named
    if isinstance(positions, int):
        return from_k
    return from_mask


def _show(positions: Any) -> str:
    return "mask" if isinstance(positions, torch.Tensor) else repr(positions)


def _why_none(positions: Any) -> str:
    """Why a steer's positions chose no token of the calls that ran."""
    if isinstance(positions, str) and positions == "generated":
        return "the model only ran on prompts: 'generated' steers the tokens generate() adds"
    if isinstance(positions, str):
        return "every call was past the prompt"
    if isinstance(positions, int):
        return (
            f"no row reached position {positions} (positions count each row's real tokens from 0)"
            if positions >= 0
            else "every token of the calls was padding"
        )
    return (
        "the mask selects no real token that ran: mask[b, p] steers row b's p-th real token, "
        "padding taken out"
    )


def _dev(step: Any) -> torch.device:
    return step.device


_KINDS = "'all', 'prompt', 'generated', an int (k: positions k and later; -k: the last k tokens) or a bool mask"


def _check_scale(scale: Any) -> float:
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point():
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"steer: scale must be a number, got {type(scale).__name__} {scale!r}"
            + (
                f"; pass scale={float(scale)}"
                if isinstance(scale, str) and _is_number(scale)
                else ""
            )
        )
    if not math.isfinite(scale):
        raise ValueError(f"steer: scale must be finite, got {scale}")
    return float(scale)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _check_positions(positions: Any) -> None:
    if isinstance(positions, str) and positions not in _NAMED:
        raise ValueError(f"steer: positions must be {_KINDS}; got {positions!r}")
    if isinstance(positions, bool) or not isinstance(positions, (str, int, torch.Tensor)):
        raise TypeError(f"steer: positions must be {_KINDS}; got {type(positions).__name__}")
    if isinstance(positions, torch.Tensor) and (
        positions.dtype != torch.bool or positions.dim() not in (1, 2)
    ):
        raise ValueError(
            "steer: a positions mask must be a bool tensor [batch, positions] or [positions]; "
            f"got {positions.dtype} of shape {tuple(positions.shape)}"
        )


def _check_vector(sel: Any, vec: Any, mode: str) -> None:
    if not isinstance(vec, torch.Tensor) or vec.dim() != 1:
        raise HookscopeError(
            f"steer: the vector for {sel!r} must be a 1-D tensor (one value per feature); got "
            f"{type(vec).__name__} {tuple(getattr(vec, 'shape', ()))}"
        )
    if not vec.is_floating_point():
        raise HookscopeError(
            f"steer: the vector for {sel!r} is {vec.dtype}; give a floating tensor (vector.float())"
        )
    if vec.device.type != "meta":
        bad = ~torch.isfinite(vec)
        if bool(bad.any()):
            raise HookscopeError(
                f"steer: the vector for {sel!r} has {int(bad.sum())} non-finite values "
                f"(NaN or inf; first at index {int(bad.nonzero()[0, 0])}); steering with it "
                "would make every steered value NaN/inf"
            )
        if mode == "ablate" and not bool(vec.any()):
            raise HookscopeError(f"steer(mode='ablate'): the direction for {sel!r} is zero")


def _warn_twice(plan: list[tuple[str, nn.Module, torch.Tensor]], mode: str) -> None:
    """Warn where a module is steered twice: selected by two keys (both vectors are applied, one
    after the other), or inside another module steered (a glob such as ``"*.mlp"`` or
    ``"model.layers.*"`` matching a block and its submodules: the submodule's change reaches the
    block's output, which is changed again)."""
    seen: dict[int, str] = {}
    twice: list[str] = []
    for name, module, _ in plan:
        if id(module) in seen:
            twice.append(
                repr(name) if seen[id(module)] == name else f"{name!r} (as {seen[id(module)]!r})"
            )
        seen.setdefault(id(module), name)
    names = sorted({name for name, _, _ in plan})
    nested = [
        f"{inner!r} inside {outer!r}"
        for outer in names
        for inner in names
        if inner != outer and (outer == "" or inner.startswith(outer + "."))
    ]
    if not twice and not nested:
        return
    parts = []
    if twice:
        parts.append(
            f"selected by two keys: {', '.join(twice[:3])}{' ...' if len(twice) > 3 else ''}"
        )
    if nested:
        parts.append(f"{', '.join(nested[:3])}{' ...' if len(nested) > 3 else ''}")
    verb = "ablated" if mode == "ablate" else "steered"
    warnings.warn(
        f"steer: modules {verb} twice ({'; '.join(parts)}): each change is applied, the inner "
        "one reaching the outer module's output, which is changed again; select each module "
        "once (a narrower glob, e.g. 'model.layers.*.mlp' rather than '*.mlp' with its blocks)",
        HookscopeWarning,
        stacklevel=3,
    )


def steer(
    model: nn.Module,
    vectors: Mapping[Selector, torch.Tensor],
    *,
    scale: float = 1.0,
    positions: Positions = "all",
    mode: Literal["add", "ablate"] = "add",
) -> Steering:
    """Steer a model while the returned scope is active: add ``scale * vector`` to each layer's
    output (for a tuple output, to its first item, the hidden states), or with ``mode="ablate"``
    project the vector's direction out (``h - scale * (h·u) u``, ``u`` the unit vector).

    Works in plain forwards and in ``model.generate()`` (see the generation guide for the caches
    and architectures: dynamic, static and sliding-window caches, greedy, sampling and beam
    search, state-space models, the decoder of an encoder–decoder model). ``positions`` selects
    the tokens by their *position*: the number of real tokens before them in their row, counted
    over the whole sequence (prompt and generated tokens), padding taken out:

    * ``"all"`` (the default): every position of every call (padded slots too; they are masked
      out of attention, so real tokens see the same result); no token tracking;
    * ``"prompt"`` / ``"generated"``: the tokens of the first call of a sequence (the prompt; in
      ``generate``, the ``input_ids`` it was given, also when its first call holds candidates
      after them: prompt-lookup or assisted decoding) / the tokens ``generate`` adds;
    * an int ``k >= 0``: positions ``k`` and later (as ``steering-vectors``' ``min_token_index``,
      but also for tokens generated with the KV cache);
    * a negative int ``-k``: the last ``k`` tokens of each row in each call (``-1``: the last
      token; in ``generate``: the prompt's last ``k`` tokens, then every generated token, which is
      the last one when it is computed; also with ``use_cache=False`` and candidates);
    * a bool mask ``[batch, positions]`` (or ``[positions]`` for every row): ``mask[b, p]``
      steers row ``b``'s ``p``-th token; positions past the mask's end are not steered.

    On an encoder–decoder model, positions count the decoder's tokens; encoder layers take
    ``positions="all"``. ``scale`` is a finite number; the vectors are finite floating tensors,
    used in float32 (or the output's wider dtype): a bf16/fp16 output gets the float32 result
    rounded once, as ``steering-vectors``' ``apply`` does.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Embedding.from_pretrained(torch.ones(5, 2)), nn.Identity())
        >>> with hs.steer(net, {"0": torch.tensor([1.0, 0.0])}, scale=2.0, positions=1):
        ...     out = net(torch.tensor([[3, 3]]))
        >>> out[0].tolist()  # position 1 steered: (1, 1) + 2 * (1, 0)
        [[1.0, 1.0], [3.0, 1.0]]
    """
    check_model(model)
    if mode not in ("add", "ablate"):
        raise ValueError(f"steer: mode must be 'add' or 'ablate', got {mode!r}")
    scale = _check_scale(scale)
    _check_positions(positions)
    plan: list[tuple[str, nn.Module, torch.Tensor]] = []
    for sel, vec in vectors.items():
        _check_vector(sel, vec, mode)
        for name, module in find(model, sel).items():
            plan.append((name, module, vec))
    _warn_twice(plan, mode)
    scope = Steering()
    scope.positions = positions
    scope.layers = [n for n, _, _ in plan]
    try:
        tracker = None
        if not (isinstance(positions, str) and positions == "all"):
            tracker = scope.tracker = TokenTracker()
            # negative positions count within each call: where the call starts does not matter
            tracker.within = isinstance(positions, int) and positions < 0
            tracker.attach(scope, model, reorders=False)
        select = _selector(positions, tracker)
        scope.add_forward_pre(strip_compiled(model), scope._on_model_call, layer="")
        for name, module, vec in plan:
            hook = _SteerHook(name, vec, scale, mode, select, scope)
            scope.hooks.append(hook)
            scope.add_forward(module, hook, layer=name)
        scope.track(model, {name: module for name, module, _ in plan})  # (replaced: warned)
    except BaseException:
        scope.remove()
        raise
    return scope
