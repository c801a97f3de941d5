"""What ``hs.compare`` checks before it compares: its arguments (types and values, at entry), the
``names=`` mapping against the modules of both runs, and a recorded run against the live one (the
same inputs, the same loss: the output gradient ``loss_fn`` gives at the recorded output must be
the recorded one). Each refusal is one line naming the argument and the fix."""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import NONE_RAN, named_modules
from ..core._errors import HookscopeWarning, some_names
from ..core._nested import continuous, iter_tensors, map_tensors
from ..core._select import suggest
from ..core._signature import forward_parameters
from ._ranks import REDUCTIONS
from ._record import of_ranks
from ._run import CompareError, RunRecord, quantized_shown
from ._tolerance import lower, rel_pairs, tolerance

__all__ = ["check_arguments", "check_hooks_ran", "check_loss", "check_names", "check_reduction"]

_AUTOCAST = (torch.float16, torch.bfloat16)
_NAMES_FORMS = (
    "hs.compare: names= must be a dict {name in a: name in b or None} (str keys and values) "
    "or a function name_in_a -> name_in_b or None"
)


def check_arguments(a: Any, b: Any, spec: Any, names: Any, loss_reduction: Any = None) -> None:
    """Types and values of compare's arguments, before anything runs (``spec``: a
    :class:`~._run.RunSpec` of B, carrying inputs, loss_fn, autocast and max_bytes;
    ``loss_reduction``: as given, ``None`` when not given)."""
    if isinstance(a, nn.Module) and a is b:
        raise CompareError(
            "hs.compare: a and b are the same model object, so every difference is 0; compare "
            "it with a copy: b = copy.deepcopy(a), then change b"
        )
    _check_names_type(names)
    check_reduction(loss_reduction, a, b)
    _check_max_bytes(spec.max_bytes)
    _check_autocast(spec.autocast, b)
    if spec.loss_fn is not None:
        if not callable(spec.loss_fn):
            raise TypeError(
                f"hs.compare: loss_fn= must be a function output -> scalar tensor, "
                f"got {type(spec.loss_fn).__name__} (not callable)"
            )
        mode = (
            "torch.inference_mode()"
            if torch.is_inference_mode_enabled()
            else "torch.no_grad()"
            if not torch.is_grad_enabled()
            else None
        )
        if mode is not None:
            raise CompareError(
                f"hs.compare: called under {mode}, yet loss_fn= asks for a backward; call "
                f"hs.compare outside {mode}, or leave out loss_fn to compare the forward only"
            )
    for what, m in (("a", a), ("b", b)):
        if isinstance(m, nn.Module):
            _check_call(m, what, spec.args, spec.kwargs)


def check_kinds(a: nn.Module, b: nn.Module, to_b: Callable[[str], str | None]) -> None:
    """Warn where a parameter or buffer complex in A is real in B:
    ``b = copy.deepcopy(a).to(torch.bfloat16)`` casts a complex buffer (a rotary table kept as
    ``complex64``) to a real one, dropping its imaginary part (PyTorch warns once, without a
    name); the module holding it is then B's culprit by right, and this says why."""
    mods_b = dict(named_modules(b))
    changed = []
    for name, m in named_modules(a):
        tensors = [*m._parameters.items(), *m._buffers.items()]
        if not any(t is not None and t.is_complex() for _, t in tensors):
            continue
        bn = to_b(name)
        mb = mods_b.get(bn) if bn is not None else None
        if mb is None:
            continue
        for local, t in tensors:
            other = mb._parameters.get(local, mb._buffers.get(local))
            if t is not None and other is not None and t.is_complex() and not other.is_complex():
                full = f"{name}.{local}" if name else local
                changed.append(f"{full!r} ({str(t.dtype)[6:]} in a, {str(other.dtype)[6:]} in b)")
    if changed:
        warnings.warn(
            f"hs.compare: complex tensors became real in b: {', '.join(changed[:3])}"
            f"{' ...' if len(changed) > 3 else ''}; "
            "Module.to(torch.bfloat16) casts a complex parameter or buffer to a real one and drops "
            "its imaginary part, so the module holding it computes something else; cast b's "
            "floating tensors only: b._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)",
            HookscopeWarning,
            stacklevel=3,
        )


def check_quantized(model: Any, what: str, grads: bool) -> str | None:
    """A model with quantized modules (live, or a record that says so): their kernels have no
    backward in PyTorch (the gradient stops there, ``None`` upstream, with only PyTorch's
    generic warning), so with ``loss_fn`` the gradients of every module before them would be
    missing and compared nowhere: a live one is refused (:class:`~._record.Record` refuses a
    backward through them). Without it: a warning, and the report's note (returned), that
    their errors include quantization's, which the tolerances of the float dtypes do not allow
    for (they are flagged by it)."""
    shown = model.quantized if isinstance(model, RunRecord) else None
    if isinstance(model, nn.Module):
        shown = quantized_shown(model)
        if shown and grads:
            raise CompareError(
                f"hs.compare: model {what!r} has quantized modules {shown}: PyTorch's quantized "
                "kernels have no backward, so no gradient reaches the modules before them and "
                "the gradients could not be compared; compare without loss_fn (forward only), "
                "or compare the float model with loss_fn"
            )
    if not shown:
        return None
    why = (
        f"{what}'s modules {shown} are quantized: they compute with quantization's error, which "
        "the tolerances of the float dtypes do not allow for, so they are flagged by it; to find "
        "a fault in a quantized model, compare it with a model quantized the same way"
    )
    warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)
    return why


def check_modes(ra: RunRecord, rb: RunRecord, names: Any) -> None:
    """Warn where a module whose forward reads ``self.training`` is in training mode in one run
    and in eval mode in the other (live models, or records that kept their modes): its
    computation differs (BatchNorm's batch statistics against its running ones), so it is named
    as a culprit, by its mode, not by its code."""
    ma, mb = ra.modes, rb.modes
    if ma is None or mb is None:  # a record made before modes were kept
        return
    rename: Callable[[str], str | None]
    if names is None:
        rename = lambda n: n  # noqa: E731
    elif isinstance(names, Mapping):
        table = dict(names)
        rename = lambda n: table.get(n, n)  # noqa: E731
    else:
        rename = names
    differ = []
    for name, (training, by_mode) in ma.items():
        other = rename(name)
        got = mb.get(other) if other is not None else None
        if got is not None and got[0] != training and (by_mode or got[1]):
            differ.append((name or "<root>", training))
    if differ:
        shown = ", ".join(f"{n} ({'train' if t else 'eval'} in a)" for n, t in differ[:3])
        warnings.warn(
            f"hs.compare: {len(differ)} module(s) are in training mode in one run and in eval "
            f"mode in the other: {shown}{' ...' if len(differ) > 3 else ''}; a module that "
            "computes differently by mode (BatchNorm, dropout) is then named for its mode, not "
            "its code: call .eval() (or .train()) on both models (for a record: record the "
            "model in the mode you compare it in)",
            HookscopeWarning,
            stacklevel=3,  # check_modes, hs.compare, the caller
        )


def check_reduction(loss_reduction: Any, a: Any, b: Any) -> None:
    """``loss_reduction=`` (``None``: not given) must be one of :data:`~._ranks.REDUCTIONS`, and
    is refused where it would be ignored: neither ``a`` nor ``b`` a record made on several ranks."""
    if loss_reduction is None:
        return
    if not isinstance(loss_reduction, str) or loss_reduction not in REDUCTIONS:
        raise CompareError(
            f"hs.compare: loss_reduction={loss_reduction!r} is not one of "
            f"{', '.join(map(repr, REDUCTIONS))} (how the loss of each rank reduced its share of "
            "the batch, for a record made on several ranks)"
        )
    if not any(isinstance(m, (str, os.PathLike)) and of_ranks(m) for m in (a, b)):
        raise CompareError(
            f"hs.compare: loss_reduction={loss_reduction!r} applies only to a record made on "
            "several ranks (how each rank's loss reduced its share of the batch), and neither a "
            "nor b is one; leave out loss_reduction"
        )


def _check_names_type(names: Any) -> None:
    if names is None or (callable(names) and not isinstance(names, Mapping)):
        return
    if not isinstance(names, Mapping):
        raise TypeError(f"{_NAMES_FORMS}; got {type(names).__name__}")
    for k, v in names.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, str)):
            raise TypeError(f"{_NAMES_FORMS}; got the entry {k!r}: {v!r}")


def _check_max_bytes(max_bytes: Any) -> None:
    if max_bytes is None:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(
            f"hs.compare: max_bytes= must be an int (bytes kept in memory per run) or None, "
            f"got {type(max_bytes).__name__} {max_bytes!r}"
        )
    if max_bytes < 0:
        raise CompareError(
            f"hs.compare: max_bytes={max_bytes} is negative; give 0 or more bytes (0: every "
            "value goes to disk) or None (no bound)"
        )


def _check_autocast(autocast: Any, b: Any) -> None:
    if autocast is None:
        return
    if not isinstance(autocast, torch.dtype):
        raise TypeError(
            f"hs.compare: autocast= must be a torch.dtype (torch.bfloat16 or torch.float16) or "
            f"None, got {type(autocast).__name__} {autocast!r}"
        )
    if autocast not in _AUTOCAST:
        raise CompareError(
            f"hs.compare: autocast={autocast} is no autocast dtype; give torch.bfloat16 or "
            "torch.float16 (or cast b itself: b.to(dtype))"
        )
    if not isinstance(b, nn.Module):
        raise CompareError(
            "hs.compare: autocast= runs a live b under torch.autocast, but b is a record; "
            "record b under torch.autocast instead, or pass the live model"
        )


def _check_call(model: nn.Module, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    params = forward_parameters(model)
    if not params:
        return
    try:
        inspect.Signature(list(params.values())).bind(*args, **kwargs)
    except TypeError as exc:
        raise CompareError(
            f"hs.compare: model {what} ({type(model).__name__}) cannot take the inputs given "
            f"({len(args)} positional, keywords {sorted(kwargs)}): {exc}; pass the inputs of "
            "its forward after a and b: hs.compare(a, b, *inputs, **kwargs)"
        ) from None


def _known(rec: RunRecord) -> list[str]:
    if rec.modules is not None:
        return list(rec.modules)
    seen = dict.fromkeys(c.name for c in rec.calls)
    seen.update(dict.fromkeys(rec.params.values()))
    return list(seen)


def _unknown(name: str, what: str, rec: RunRecord) -> CompareError:
    known = _known(rec)
    close = suggest(name, known, n=3) or [x for x in known if x][:3]
    return CompareError(
        f"hs.compare: names= maps to or from {name!r}, which is not a module of {what}; closest "
        f"names of {what}: {some_names(close)}"
    )


def check_names(names: Any, ra: RunRecord, rb: RunRecord) -> None:
    """Every key of a ``names=`` dict is a module of A and every target a module of B; a function
    returns, for each of A's modules, ``None``, A's own name, or a module of B."""
    if names is None:
        return
    in_a, in_b = set(_known(ra)), set(_known(rb))
    target: dict[str, str | None] = {}
    if isinstance(names, Mapping):
        for k, v in names.items():
            if k not in in_a:
                raise _unknown(k, "a", ra)
            if v is not None and v not in in_b:
                raise _unknown(v, "b", rb)
        target = {n: names.get(n, n) for n in _known(ra)}
    else:
        fn: Callable[[str], str | None] = names
        for n in _known(ra):
            try:
                v = fn(n)
            except Exception as exc:
                raise CompareError(
                    f"hs.compare: names= raised {type(exc).__name__} ({exc}) for A's module "
                    f"{n or '<root>'!r}; return B's name for it, or None where it has no "
                    "counterpart"
                ) from None
            if v is not None and not isinstance(v, str):
                raise CompareError(
                    f"hs.compare: names= returned {v!r} ({type(v).__name__}) for A's module "
                    f"{n or '<root>'!r}; return B's name for it (a str), or None"
                )
            if v is not None and v != n and v not in in_b:
                raise _unknown(v, "b", rb)
            target[n] = v
    # one to one: a module of B stands for one module of A (its calls are paired once)
    seen: dict[str, str] = {}
    for n, v in target.items():
        if v is None:
            continue
        if v in seen:
            raise CompareError(
                f"hs.compare: names= maps A's modules {seen[v] or '<root>'!r} and "
                f"{n or '<root>'!r} both to B's {v or '<root>'!r}; a module of B stands for one "
                "of A: map one of them to another module of B, or to None"
            )
        seen[v] = n


def check_loss(rec: RunRecord, what: str, loss_fn: Any, device: torch.device) -> None:
    """A recorded run compared with ``loss_fn`` must have gradients, made by that loss: the
    gradient ``loss_fn`` gives at the recorded model output must be the recorded one."""
    if not rec.has_grads:
        raise CompareError(
            f"hs.compare: the record {what} holds no gradients (no backward ran inside hs.record), "
            "yet loss_fn= asks to compare them; leave out loss_fn, or record again with "
            "`loss_fn(model(x)).backward()` inside the with block"
        )
    pos = rec.by_key.get(("", 0))
    if pos is None:  # a record of some layers: the model's output is not in it
        _unchecked(
            what,
            "it holds no call of the model itself (hs.record's layers= left it out)",
            "record with the model included, layers=['', ...]",
        )
        return
    call = rec.calls[pos]
    if pos in rec.notes:
        _unchecked(
            what,
            f"the model's own call cannot be joined across its ranks ({rec.notes[pos]})",
            "make each tensor of the output batched (first dimension the share) or equal on "
            "every rank",
        )
        return
    recorded, output = call.grad, call.output
    if recorded is None or output is None:
        return
    out = map_tensors(lambda t: t.detach().to(device).requires_grad_(continuous(t)), output)
    leaves = [t for _, t in iter_tensors(out)]
    try:
        with torch.enable_grad():
            loss = loss_fn(out)
            wanted = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    except Exception as exc:  # a loss that cannot run on the recorded output alone: say so
        warnings.warn(
            f"hs.compare: could not check loss_fn against the record {what} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); "
            "make sure it is the loss the record was made with",
            HookscopeWarning,
            stacklevel=3,
        )
        return
    mine = [next(got) if t.requires_grad else None for t in leaves]
    pairs = list(zip(recorded, mine))
    # a leaf the recorded loss reached and this one does not (or the other way): another loss
    one_sided = any((x is None) != (y is None) for x, y in pairs)
    err = math.inf if one_sided else rel_pairs(pairs)
    k = max((t.shape[-1] for t in leaves if t.ndim), default=1)
    low = rec.run_dtype  # the output may be in a lower dtype (recorded under autocast)
    for t in leaves:
        low = lower(low, t.dtype) if t.is_floating_point() else low
    if err is None or err <= 8 * tolerance(low, k):
        return
    err_s = f"{err:.2e}" if math.isfinite(err) else "inf (other leaves or shapes)"
    raise CompareError(
        f"hs.compare: record {what}: the output gradient loss_fn gives at the recorded output "
        f"differs from the recorded one by {err_s}: the record was made with another loss; pass "
        "the loss the record's backward used as loss_fn (scaling included; on the command line "
        "--loss sum or square, or --loss none to compare the forward only)"
    )


def _unchecked(what: str, why: str, fix: str) -> None:
    warnings.warn(
        f"hs.compare: loss_fn cannot be checked against the record {what}: {why}; a loss other "
        "than the one the record was made with would go unnoticed (every gradient compared "
        f"against another loss's); {fix} to have it checked",
        HookscopeWarning,
        stacklevel=4,  # _unchecked, check_loss, hs.compare, the caller
    )


def check_hooks_ran(
    other: RunRecord,
    live: RunRecord,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    autocast: torch.dtype | None,
    rename: Callable[[str], str | None],
    what: str,
) -> str | None:
    """The live run's modules that the other run called, and the live run did not, though the
    live model has them: run the live model once more eagerly (``force_eager``: compiled code
    set aside) counting their calls. A module it calls then was skipped by its compiled code (a
    graph Dynamo compiled before hs.compare added its hooks: it does not guard on hooks), which
    would leave its rows out and the culprit unseen: refused naming the modules and the fix. A
    module not called eagerly either does not run for these inputs (listed as unmatched). When
    the eager run fails and the live run was compiled, no verdict: a warning, and the report's
    note (returned), say so."""
    from ..core._buffers import state_kept
    from ..core._scope import HookScope
    from ._run import _autocast, _device, cast_like, model_dtype

    called = {c.name for c in live.calls}
    modules = live.modules or {}
    want = sorted(
        {
            n
            for c in other.calls
            for n in (rename(c.name),)
            if n is not None and n in modules and n not in called
        }
    )
    if not want or not hasattr(torch.compiler, "set_stance"):
        return None
    counts = dict.fromkeys(want, 0)
    scope = HookScope("compare-check")

    def counter(name: str) -> Callable[..., None]:
        def pre(_m: nn.Module, _args: Any) -> None:
            counts[name] += 1

        return pre

    for n in want:
        scope.add_forward_pre(modules[n], counter(n), layer=n)
    device = _device(model)
    dtype = model_dtype(model)
    x = cast_like(args, dtype, device, objects=True)
    kw = cast_like(kwargs, dtype, device, objects=True)
    try:
        with (
            scope,
            state_kept(model),
            torch.no_grad(),
            _autocast(device, autocast),
            torch.compiler.set_stance("force_eager"),
            warnings.catch_warnings(),
        ):
            # the counting hooks not running is what this run finds out, not a warning to the
            # user (a compiled region warns when none of its hooks ran)
            warnings.filterwarnings("ignore", message=NONE_RAN, category=HookscopeWarning)
            model(*x, **kw)
    except Exception as exc:  # no verdict: said where compiled code may have skipped hooks
        if not live.compiled:
            return None  # (an eager run's hooks run whenever their module does: nothing skipped)
        why = (
            f"{what}: {len(want)} module(s) of {what} ({some_names(want)}) did not run in its "
            "compiled recorded run though the other run called them, and whether its compiled "
            f"code skipped their hooks could not be checked: {what} run eagerly (compiled code "
            f"set aside) failed ({type(exc).__name__}: {str(exc)[:160]}). If code Dynamo "
            "compiled before hs.compare added its hooks ran them, their rows, and a fault in "
            "them, are left out (listed as unmatched); call torch._dynamo.reset() before "
            f"hs.compare, or make {what} run eagerly (torch.compiler.set_stance('force_eager')) "
            "to have it checked"
        )
        warnings.warn(f"hs.compare: {why}", HookscopeWarning, stacklevel=3)
        return why
    ran = [n for n in want if counts[n]]
    if ran:
        raise CompareError(
            f"hs.compare: the hooks on {len(ran)} module(s) of {what} ({some_names(ran)}) did "
            f"not run in its compiled code, though {what} calls them (run eagerly) and the other "
            "run did: code Dynamo compiled before hs.compare added its hooks skips them (it "
            f"does not guard on hooks: {what} was called before, or its forward was compiled as "
            "a function), so their rows, and a fault in them, would be left out. Compile the "
            f"module itself (torch.compile(model) or model.compile()) and call hs.compare before "
            "its first call, or call torch._dynamo.reset() before hs.compare"
        )
    return None
