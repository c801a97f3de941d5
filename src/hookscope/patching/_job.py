"""One patching run, resolved once: the model's modules, device and repeated blocks, the patched
run's inputs, the metric, the rows a pass may hold; and the checks every run makes (the model
draws no random numbers and mixes no rows, the metric gives one number, the layer ran once)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import named_modules
from ..core._nested import iter_tensors
from ..core._random import draw_fix, draw_place, random_draws
from ..core._scope import HookScope, check_model, model_device
from ._batching import default_budget
from ._inputs import PatchingError, as_kwargs, batch_size, check_aligned, check_count
from ._sites import PatchedLayer, get_act, names_of_blocks

__all__ = ["PatchMetric", "SweepJob", "check_calls", "prepare", "score"]

PatchMetric = Callable[[Any], Any]
"""``metric(output) -> scalar``: the model's output for one site's rows (as many rows as the
input batch; a tensor, or a ``ModelOutput`` with its ``.logits``)."""


def prepare(
    model: nn.Module, clean: Any, corrupt: Any, reverse: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source run's and the patched run's keyword inputs, checked to align."""
    check_model(model)
    src = as_kwargs(model, clean, "clean")
    dst = as_kwargs(model, corrupt, "corrupt")
    check_aligned(model, src, dst)
    if reverse:
        src, dst = dst, src
    return src, dst


def _check_modules(modules: dict[str, nn.Module], what: str) -> None:
    for name, m in modules.items():
        meta = next((n for n, t in m.named_parameters(recurse=False) if t.is_meta), None)
        meta = meta or next((n for n, t in m.named_buffers(recurse=False) if t.is_meta), None)
        if meta is not None:
            shown = f"{name}.{meta}" if name else meta
            raise PatchingError(
                f"{what}: the model's weights are on the meta device ({shown!r}: shapes, no "
                "values); load real weights first (e.g. model.to_empty(device='cpu') then "
                "load_state_dict, or from_pretrained without device_map='meta')"
            )
        if m.training and isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise PatchingError(
                f"{what}: batch norm {name!r} is in training mode: it normalises with the "
                "batch's statistics, which would mix the rows of different sites; call "
                "model.eval() first"
            )


def check_calls(layer: PatchedLayer, n: int) -> None:
    """Raise unless the module holding ``layer``'s activation ran once in a forward."""
    if n == 1:
        return
    if n == 0:
        raise PatchingError(
            f"{layer.point!r} never ran through module(...) in the forward pass, so it cannot be "
            "patched (PyTorch runs hooks only through __call__; e.g. nn.MultiheadAttention calls "
            "its out_proj's weights directly). Select a layer that runs"
        )
    raise PatchingError(
        f"{layer.point!r} ran {n} times in one forward pass; a patch would change every call. "
        "Select a module that runs once"
    )


def score(value: Any, layer: str) -> torch.Tensor:
    """The metric's value as a float32 scalar (float64 where the metric gives float64: a
    float64 model's values are not rounded); a one-line error for anything else."""
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, numbers.Real):
        t = torch.tensor(float(value))
    else:
        raise PatchingError(
            f"metric must return a number (a scalar tensor or a float); it returned "
            f"{type(value).__name__} at layer {layer!r}. Return one number computed from the "
            "output, e.g. out.logits[:, -1, i].mean()"
        )
    if t.ndim != 0:
        raise PatchingError(
            f"metric must return a scalar (one number for the batch, as in TransformerLens); "
            f"it returned shape {tuple(t.shape)} at layer {layer!r}. Reduce it, e.g. .mean()"
        )
    return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32)


@dataclass
class SweepJob:
    """What every layer of one sweep shares, resolved from the model once.

    ``modules`` by their eager names (through a compiled wrapper), ``device``, ``block_names``
    (the repeated blocks, ``[]`` where there are none), ``dst`` the patched run's keyword inputs
    of ``batch`` rows, ``over`` the sweep axes, ``rows``/``budget`` what a pass may hold,
    ``per_row`` the bytes a row of a pass needs (from the clean run), ``max_sites`` a cap on
    the sites of a pass once one ran out of memory. (Its hooks live in core scopes, which act
    only on the calls of the thread that runs the sweep: another thread's forwards of the same
    model run unpatched and uncounted.)
    """

    model: nn.Module
    dst: dict[str, Any]
    batch: int
    metric: PatchMetric
    over: tuple[str, ...]
    rows: int | None
    budget: int
    modules: dict[str, nn.Module]
    device: torch.device
    block_names: list[str]
    per_row: int = 1
    max_sites: int | None = None

    @classmethod
    def create(
        cls,
        model: nn.Module,
        dst: dict[str, Any],
        metric: PatchMetric,
        over: tuple[str, ...],
        *,
        rows: int | None = None,
        max_bytes: int | None = None,
        what: str = "patch_sweep",
        block_names: list[str] | None = None,
    ) -> SweepJob:
        """Resolve ``model`` once; refuse one without values (meta device) or that mixes the rows
        of a batch (batch norm in training mode), naming ``what`` was called."""
        modules = dict(named_modules(model))
        _check_modules(modules, what)
        check_count(rows, "rows", "rows per pass")
        device = model_device(model)
        names = block_names if block_names is not None else names_of_blocks(model)
        return cls(
            model,
            dst,
            batch_size(dst),
            metric,
            over,
            rows,
            max_bytes if max_bytes is not None else default_budget(device),
            modules,
            device,
            names,
        )

    def score(self, out: Any, layer: PatchedLayer) -> torch.Tensor:
        return score(self.metric(out), layer.name)

    def record(
        self, kwargs: dict[str, Any], layers: list[PatchedLayer], *, what: str = ""
    ) -> tuple[dict[str, torch.Tensor], Any, int]:
        """One forward on ``kwargs``: each layer's activation (a copy), the output, and the bytes
        a row of a pass needs (on CUDA the forward's measured peak per row; elsewhere 24x the
        largest activation patched plus the model's output, per row). With ``what`` (the caller's
        name), refuses a model whose forward is not the same from run to run, so that a patch's
        effect would be noise: one that draws from torch's global generators (dropout in
        training mode, as a module or a function), and, by a second forward compared exactly,
        any other (a generator of its own, a nondeterministic kernel)."""
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        with random_draws() as draws:
            acts, out = self._hooked_forward(kwargs, layers)
        if cuda:  # measured: the forward's peak on the device
            peak = torch.cuda.max_memory_allocated(self.device) - before
        if what and draws.drew:
            raise PatchingError(_draws_message(what, self.model, kwargs))
        if what:
            again_acts, again = self._hooked_forward(kwargs, layers)
            _check_repeatable(what, (acts, out), (again_acts, again))
            del again_acts, again
        out_bytes = sum(t.nbytes for _, t in iter_tensors(out))
        if not cuda:  # estimated (calibrated with the profiler on GPT-2: peak <= budget)
            peak = 24 * max(t.nbytes for t in acts.values()) + out_bytes
        return acts, out, max(1, peak // max(1, self.batch))

    def _hooked_forward(
        self, kwargs: dict[str, Any], layers: list[PatchedLayer]
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """A forward on ``kwargs`` keeping a copy of each layer's activation; refuses a layer
        that did not run exactly once."""
        acts: dict[str, torch.Tensor] = {}
        calls: dict[str, int] = {}
        with HookScope("patch_sweep") as scope:
            for layer in {layer.point: layer for layer in layers}.values():

                def keep(module: nn.Module, args: Any, kwargs: Any, output: Any = None, s=layer):
                    calls[s.point] = calls.get(s.point, 0) + 1
                    acts[s.point] = get_act(s, module, args, kwargs, output).detach().clone()

                if layer.kind == "input":
                    scope.add_forward_pre(
                        self.modules[layer.point], keep, layer=layer.point, with_kwargs=True
                    )
                else:
                    scope.add_forward(
                        self.modules[layer.point],
                        lambda m, a, k, o, keep=keep: keep(m, a, k, o),
                        layer=layer.point,
                        with_kwargs=True,
                    )
            out = self.model(**kwargs)
        for layer in layers:
            check_calls(layer, calls.get(layer.point, 0))
        return acts, out


def _draws_message(what: str, model: nn.Module, kwargs: dict[str, Any]) -> str:
    """Why a forward that drew from torch's global generators is refused: where (the forward run
    again, each module call watched), and the fix that applies: eval() where modules are in
    training mode, else the functional cause."""
    where = draw_place(model, lambda: model(**kwargs), kwargs)
    return (
        f"{what}: the model draws random numbers{where}, so every run differs and a patch's "
        f"effect would be noise; {draw_fix(model)}"
    )


def _same(a: Any, b: Any) -> bool:
    """Whether two nested outputs hold exactly the same tensors (NaN equal to NaN)."""
    ta, tb = list(iter_tensors(a)), list(iter_tensors(b))
    if len(ta) != len(tb):
        return False
    for (_, x), (_, y) in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            if not bool(((x == y) | (x.isnan() & y.isnan())).all()):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _check_repeatable(
    what: str, first: tuple[dict[str, Any], Any], second: tuple[dict[str, Any], Any]
) -> None:
    """Refuse two forwards on the same inputs that differ: name the first layer (in the
    model's order of the selection) whose activation differs, else the output."""
    for point, act in first[0].items():
        if not _same(act, second[0].get(point)):
            where = f"the activation of {point!r}"
            break
    else:
        if _same(first[1], second[1]):
            return
        where = "the output"
    raise PatchingError(
        f"{what}: two forwards of the model on the same clean inputs gave different values "
        f"({where}), though it draws nothing from torch's global generators: its forward is "
        "random by other means (a torch.Generator of its own, e.g. torch.rand(..., "
        "generator=g); a nondeterministic kernel), so a patch's effect would be noise; make "
        "the forward repeatable (e.g. reseed its generator at the start of forward, or "
        "torch.use_deterministic_algorithms(True))"
    )
