"""``Monitor``: per-layer training statistics, diagnosis, NaN/Inf origin, sinks; two lines in a loop.

Hooks exist only for the steps that are logged: with ``every=N`` the monitor attaches its scope at
the ``step()`` that precedes a logged step and removes it at the ``step()`` that records it, so the
other ``N - 1`` steps run on PyTorch's no-hook fast path. Statistics are computed on the device
(fp32, foreach ops) inside the hooks and read with one host transfer per logged step. Parameter
gradients are read from ``.grad`` at ``step()``, after backward (and after DDP averaged them),
never from a module backward hook (docs/pitfalls.md §7, §18).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core._compiled import named_modules, named_parameters
from ..core._errors import UnsupportedTensorError, enter_once, some_names
from ..core._scope import HookScope, attribute_path, check_model, get_ident
from ..core._select import find, resolve
from ..core._sharded import FSDP2_INSTEAD, fsdp1_loaded, fsdp1_marked, fsdp1_wrappers, local
from ._diagnose import MonitorWarning, NonFiniteWarning, Thresholds, diagnose
from ._hooks import EndPassHook, LayerHook, MarkHook, PassHook, ScaleHook, StepHooks, StepState
from ._nonfinite import NonFiniteOrigin, _Tracker
from ._pack import Packed, Packer
from ._record import MonitorRecord
from ._sharded import (
    TPLayouts,
    any_sharded,
    check_params,
    grads_reduced,
    local_tensors,
    origin_across_ranks,
    sharded_param_sumsq,
    sum_ranks_sqrt,
    tensor_parallel,
    tp_pieces,
)
from ._sinks import as_sink
from ._stats import (
    Scratch,
    combine_acts,
    combine_grads,
    param_stats,
    saturation_bounds,
)

__all__ = ["Monitor"]

log = logging.getLogger("hookscope.monitor")

_GROUPS = ("activations", "gradients", "parameters")


class Monitor:
    """Watch a training run: per-layer activation/gradient statistics, parameter gradient, weight
    and update norms, diagnosis (vanishing, exploding, dead units, saturation) and the origin of
    the first NaN/Inf. Call :meth:`step` once per optimizer step, after ``optimizer.step()``.

    With gradient accumulation, call :meth:`step` once per *optimizer* step, not per micro-batch:
    each call of the monitored model starts a micro-batch, and a record's layer statistics cover
    every micro-batch of its step (as if the micro-batches were one batch), while its parameter
    gradients are the accumulated ones. Where the monitored module itself is not called (a
    ``LightningModule`` whose ``training_step`` calls a sub-module), :meth:`micro_batch` marks
    the start of each micro-batch; the trainer callbacks in :mod:`hookscope.integrations` do it.
    A call of the model under ``torch.no_grad()`` or ``torch.inference_mode()`` (an evaluation
    inside the step) trains nothing: it is no micro-batch, and its layer calls are not recorded
    (a ``no_grad`` block inside the model's own forward, a frozen backbone, still is).

    Args:
        model: the model (a ``DistributedDataParallel``/``DataParallel`` wrapper is looked through,
            so names are the inner model's).
        layers: what to watch (see :func:`find`); default: every leaf module.
        every: log every ``every``-th step (steps ``0, every, 2*every, ...``); hooks are attached
            only for those steps.
        stats: groups to record: ``"activations"``, ``"gradients"`` (of layer outputs),
            ``"parameters"`` (grad, weight and update norms); none (``()``) only with
            ``sentinel=True``.
        sinks: where records go on logged steps: :class:`TensorBoardSink`, :class:`JsonlSink`, or
            any callable ``fn(record)``. Under torch.distributed only rank 0 writes. A sink
            that raises does not keep the record from the others; the first error is raised
            after, with notes naming its sink, the step and any other sink that raised.
        thresholds: :class:`Thresholds` or a dict of the thresholds to change.
        sentinel: also hook every module on every step and report the first layer that produced
            a NaN/Inf (forward or backward) in ``record.nonfinite`` and as a
            :class:`NonFiniteWarning`; ``monitor.nonfinite`` keeps the first one found. Calls
            the records leave out (while paused, or of the model under ``no_grad``) it leaves
            out too. To stay
            cheap it skips the gradient checks of modules whose backward cannot create a NaN/Inf
            (Conv, Linear, normalisations, ReLU, pooling); :func:`find_nonfinite` checks all.
        allow: layers allowed to produce infinities (e.g. a ``-inf`` attention mask); NaN is
            always reported. ``"<input>"`` allows an infinite model input.
        scaler: the ``torch.amp.GradScaler`` in use, so gradients are reported unscaled. A step
            the scaler skips (a gradient of the optimizer's parameters is Inf/NaN, so the weights
            do not change and the scale is lowered) is recorded with ``record.skipped = True``:
            its gradient statistics are the non-finite values that made it skip, its
            ``update_ratio`` is 0, and the sentinel does not report its backward Inf.
        alerts: ``"warn"`` (:class:`MonitorWarning`), ``"log"`` (logger ``hookscope.monitor``),
            ``"both"`` or ``"off"``; alerts are in ``record.alerts`` in every case.
        histograms: bins of device-side activation histograms over ``[-absmax, absmax]``, of
            each layer call's first micro-batch (0: none); a :class:`TensorBoardSink` with
            ``histograms=True`` asks for 32 bins. Under torch.distributed they are the
            combined batch's (every rank bins over the ranks' largest ``absmax``: one
            ``all_reduce`` per monitored layer call of a logged step).
        keep: how many records ``monitor.records`` keeps (``None``: all).
        first_step: the index of the first step (a run resumed from a checkpoint: the number of
            optimizer steps already taken), so that records carry the run's step and ``every``
            logs the same steps as one uninterrupted run; the trainer callbacks set it.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> with hs.Monitor(net, every=2, alerts="off") as mon:
        ...     for _ in range(3):
        ...         net(torch.randn(16, 4)).pow(2).mean().backward()
        ...         opt.step(); rec = mon.step(opt); opt.zero_grad()
        >>> [r.step for r in mon.records], sorted(mon.records[-1].layers)
        ([0, 2], ['0', '1', '2'])
        >>> sorted(mon.records[-1].params["0.weight"])
        ['grad_norm', 'update_ratio', 'weight_norm']
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Any = None,
        *,
        every: int = 1,
        stats: Iterable[str] = _GROUPS,
        sinks: Iterable[Any] | Any = (),
        thresholds: Thresholds | Mapping[str, float] | None = None,
        sentinel: bool = False,
        allow: Iterable[Any] = (),
        scaler: Any = None,
        alerts: Literal["warn", "log", "both", "off"] = "warn",
        histograms: int = 0,
        keep: int | None = 1000,
        first_step: int = 0,
    ) -> None:
        inner = model
        while isinstance(inner, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = inner.module
        check_model(inner)
        self.stats = tuple(stats) if not isinstance(stats, str) else (stats,)
        _check_arguments(every, self.stats, alerts, histograms, keep, sentinel, first_step)
        self.model = inner
        self.named = find(inner, leaves=True) if layers is None else resolve(inner, layers)
        self.every, self.alerts, self.scaler = every, alerts, scaler
        self.thresholds = Thresholds.make(thresholds)
        sink_list = [sinks] if callable(sinks) or hasattr(sinks, "write") else list(sinks)
        self.sinks = [as_sink(s) for s in sink_list]
        self.bins = histograms or (
            32 if any(getattr(s, "histograms", False) for s in self.sinks) else 0
        )
        self.records: deque[MonitorRecord] = deque(maxlen=keep)
        self.nonfinite: NonFiniteOrigin | None = None
        self._origin_rank: int | None = None  # the rank whose module graph made self.nonfinite
        self._warned_shares = False  # unequal batch shares across ranks, said once
        self._warned_hist_micro = False  # histograms of the first micro-batch only, said once
        self._said: set[tuple[str, str]] = set()  # (what, parameter) said once (see _say)
        self._said_replaced: set[str] = set()  # layers said replaced in the model (once each)
        self._warned_grads = False  # parameters' gradients gone when step() read them (once)
        self._params = []
        # every parameter of the watched layers; each logged step records those that train
        # (requires_grad) then: one frozen at creation and unfrozen later (fine-tuning) was
        # never recorded, and one frozen later kept a stale .grad read as a vanishing gradient
        self._all_params: list[tuple[str, nn.Parameter]] = []
        if "parameters" in self.stats:
            self._all_params = self._select_params()
            self._params = [(n, p) for n, p in self._all_params if p.requires_grad]
            _refuse_fsdp1(self.model, self.named, self._params)
        check_params(self._params)
        self._checked = {id(p) for _, p in self._params}
        self._sharded = any_sharded(self._params)  # FSDP2 / tensor parallel: see _sharded
        layer_stats = "activations" in self.stats or "gradients" in self.stats
        # tensor parallel (alone, or with FSDP2 on a 2-D mesh): (data-parallel size, each rank's
        # tensor-parallel coordinate)
        self._tp = tensor_parallel(inner) if layer_stats else None
        self._layouts = TPLayouts(inner) if self._tp else None
        self._bounds = {n: saturation_bounds(m) for n, m in self.named.items()}
        self._step = first_step
        self._scope: HookScope | None = None
        self._state = StepState()
        self._before: list[torch.Tensor] | None = None
        self._buf: list[torch.Tensor] | None = None
        self._scratch = Scratch()
        self._closed = False
        self._want_updates = True
        self._gate = [True]  # recording on; shared with the hooks (which must not hold self)
        self._prev: tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]] | None = None
        allow = [allow] if isinstance(allow, (str, type)) else list(allow)
        sel = [a for a in allow if a != NonFiniteOrigin.INPUT]
        self._allowed = set(find(inner, *sel)) if sel else set()
        self._allow = allow
        self._tracker = self._new_tracker() if sentinel else None
        # the sentinel's ranks agree on a NaN's origin where the gradients are reduced across them
        self._reduced = sentinel and grads_reduced(self.model)
        self._attach()

    def _new_tracker(self) -> _Tracker:
        """The sentinel: every module of the model as it is now hooked (its own scope)."""
        return _Tracker(
            self.model,
            self._allow,
            skip_safe=True,
            owner="monitor.sentinel",
            gate=self._gate,
            skip_evaluations=True,
        )

    # -- selection -----------------------------------------------------------------------------
    def _select_params(self) -> list[tuple[str, nn.Parameter]]:
        ids: set[int] = set()
        for m in self.named.values():
            ids.update(id(p) for p in m.parameters())
        return [(n, p) for n, p in named_parameters(self.model) if id(p) in ids]

    def _training_params(self) -> None:
        """The parameters this logged step records: those of the watched layers that require
        grad now (frozen or unfrozen since the last logged step)."""
        # chosen again (a parameter replaced since, model.fc.weight = nn.Parameter(...), is
        # the new one: the old one was recorded, stale, for the rest of the run)
        if "parameters" in self.stats:
            self._all_params = self._select_params()
        now = [(n, p) for n, p in self._all_params if p.requires_grad]
        if [id(p) for _, p in now] == [id(p) for _, p in self._params]:
            return
        new = [(n, p) for n, p in now if id(p) not in self._checked]
        check_params(new)
        self._checked.update(id(p) for _, p in new)
        self._params = now
        self._sharded = any_sharded(now)

    @property
    def step_index(self) -> int:
        """The index of the step in progress (the next ``step()`` records this one)."""
        return self._step

    def _logged(self, step: int) -> bool:
        return step % self.every == 0

    # -- hooks (only for logged steps) ---------------------------------------------------------
    def _attach(self) -> None:
        if self._closed or not self._logged(self._step):
            return
        self._state = StepState()
        self._training_params()
        if self._params and self._want_updates:
            self._snapshot_weights()
        want_acts, want_grads = "activations" in self.stats, "gradients" in self.stats
        if not (want_acts or want_grads or self.scaler is not None):
            return
        scope = self._scope = HookScope("monitor")
        hooks = StepHooks(
            scope,
            self._state,
            self._gate,
            acts=want_acts,
            grads=want_grads,
            scratch=self._scratch,
            margin=self.thresholds.saturation_margin,
            bins=self.bins,
            scaler=self.scaler,
            layouts=self._layouts,
            shared=self._shared_range(),
        )
        try:
            if want_acts or want_grads:
                self._attach_layers(scope, hooks)
                scope.watch_unrouted(self.model, tuple(self.named), "monitored")
            if self.scaler is not None:
                for pname, p in self._params:
                    scope.add_post_accumulate_grad(p, ScaleHook(hooks), layer=pname)
        except BaseException:
            scope.remove()
            raise

    def _shared_range(self) -> bool:
        """Do this step's histograms bin over the ranks' combined range (torch.distributed)?"""
        return (
            self.bins > 0
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        )

    def _snapshot_weights(self) -> None:
        """Copy the weights before the step, for update-to-weight ratios (a buffer kept between
        logged steps: no per-step allocation)."""
        ws = local_tensors([p for _, p in self._params])
        if (
            self._buf is None
            or len(self._buf) != len(ws)
            or any(
                b.shape != w.shape or b.dtype != w.dtype or b.device != w.device
                for b, w in zip(self._buf, ws)
            )
        ):
            self._buf = [torch.empty_like(w) for w in ws]
        torch._foreach_copy_(self._buf, ws)
        self._before = self._buf

    def _attach_layers(self, scope: HookScope, hooks: StepHooks) -> None:
        """A :class:`LayerHook` per monitored layer; under tensor parallelism a :class:`MarkHook`
        on the other modules the plan names; a :class:`PassHook` on the model (micro-batches)."""
        scope.add_forward_many(
            (module, LayerHook(hooks, name, self._bounds.get(name)), name)
            for name, module in self.named.items()
        )
        scope.track(self.model, self.named)  # (a layer replaced in the model: said at step())
        if self._layouts is not None:  # modules the plan names mark their outputs' layout
            monitored = {id(m) for m in self.named.values()}
            for name, module in self._layouts.plan_modules(self.model):
                if id(module) not in monitored:
                    scope.add_forward(module, MarkHook(hooks, name), layer=name)
        scope.add_forward_pre(self.model, PassHook(hooks), layer="", prepend=True)
        scope.add_forward_many([(self.model, EndPassHook(hooks), "")], always_call=True)

    def micro_batch(self) -> None:
        """Mark the start of a micro-batch (a forward pass) of the current optimizer step: layer
        calls after it are numbered from 0 again, so each micro-batch adds to the same layer
        statistics instead of appearing as ``"layer#1"``, ``"layer#2"``. Called automatically
        when the monitored module is called; call it yourself only when the training step
        calls sub-modules directly."""
        self._state.new_pass()

    def pause(self) -> None:
        """Stop recording layer statistics until :meth:`resume` (e.g. around an evaluation loop
        run between training steps); the hooks stay, their calls are ignored."""
        self._gate[0] = False

    def resume(self) -> None:
        """Record layer statistics again after :meth:`pause`."""
        self._gate[0] = True

    def _detach(self) -> None:
        if self._scope is not None:
            self._scope.remove()
            self._scope = None

    # -- the step --------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer | None = None) -> MonitorRecord | None:
        """Close the current training step; returns its record when the step is logged (or the
        sentinel found a NaN/Inf in it), else ``None``.

        Call it after ``optimizer.step()`` (with a ``GradScaler``: after ``scaler.step(opt)``,
        before or after ``scaler.update()``) and before ``optimizer.zero_grad()``. Passing the
        optimizer adds each parameter's update-to-weight ratio. A wrapper with an ``optimizer``
        attribute (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)
        is read through to the torch optimizer; if it carries an enabled ``GradScaler`` that the
        monitor was not given, a warning says so and the monitor uses it from the next step.
        """
        if self._closed:
            return None
        if optimizer is not None:
            optimizer = self._inner_optimizer(optimizer)
        step, logged = self._step, self._logged(self._step)
        origin = self._sentinel_check(logged) if self._tracker is not None else None
        record = None
        if logged:
            scope = self._scope
            self._detach()
            if not self._check_layers_hooked(step, scope):
                self._check_layers_ran(step, scope)
            if scope is not None and scope.elsewhere:
                away = [n for n in self.named if n in scope.elsewhere]
                if away:
                    thread = scope.elsewhere[away[0]]
                    self._say(
                        "thread",
                        away,
                        "layer(s) {} ran in thread "
                        f"{thread!r}, which the model's forward started and waited on: the "
                        "Monitor's hooks act only on the calls of the thread that trains "
                        "(docs/guide/core.md, Threads), so those calls are in no record (from "
                        f"step {step} on); run those layers in the forward's own thread",
                    )
            record = self._record(step, optimizer)
            record.nonfinite = origin
            self._check_grads_read(record)
        elif origin is not None:
            record = MonitorRecord(step, nonfinite=origin)
        try:
            if record is not None:
                self._emit(record, write=logged)
        finally:
            # a sink or an alert (under -W error) that raises must not leave the step half
            # done: the next step() would record this step again, with its stale statistics
            self._want_updates = optimizer is not None
            self._before = None
            self._step += 1
            self._attach()
        return record

    def _check_layers_hooked(self, step: int, scope: HookScope | None) -> bool:
        """Warn for the monitored layers whose hooks stopped seeing their calls in this logged
        step (``scope``, removed): the model holds another module at the layer's name now (said
        once per layer: every later step misses it too), or ``hs.remove_hooks`` took the hooks
        (placed again at the next logged step). Whether every layer was lost."""
        if scope is None:
            return False
        replaced = scope.replaced_all()
        stripped = [n for n in self.named if n in scope.stripped and n not in replaced]
        new = [n for n in replaced if n not in self._said_replaced]
        if new:
            # a module at the layer's name now: watched from the next logged step on (its hooks
            # are placed anew then); a layer removed from the model: said once
            now = dict(named_modules(self.model))
            followed = [n for n in new if isinstance(now.get(n), nn.Module)]
            for n in followed:
                self.named[n] = now[n]
                self._bounds[n] = saturation_bounds(now[n])
            self._said_replaced.update(n for n in new if n not in followed)
            what = (
                "the new one's statistics are missing from this step and are recorded from the "
                "next logged step on (the Monitor hooks the module the model holds now)"
                if len(followed) == len(new)
                else "the new one's statistics are missing from this step on"
            )
            warnings.warn(
                f"step {step}: layer(s) {some_names(new)} were replaced in the model while the "
                f"Monitor watched it ({replaced[new[0]]}): its hooks were on the module it "
                f"replaced, so {what}; create the Monitor after replacing "
                f"{attribute_path(new[0])} to have them from the start",
                MonitorWarning,
                stacklevel=3,
            )
        if stripped:
            warnings.warn(
                f"step {step}: the hooks of this Monitor were removed by hs.remove_hooks(...) "
                f"during the step, so layer(s) {some_names(stripped)} recorded nothing after "
                "that; the Monitor places them again at its next logged step (keep "
                "hs.remove_hooks for scopes that were never closed)",
                MonitorWarning,
                stacklevel=3,
            )
        lost = set(replaced) | set(stripped)
        return bool(lost) and all(n in lost for n in self.named)

    def _check_grads_read(self, record: MonitorRecord) -> None:
        """Warn, once, when a step's backward reached the monitored layers (their output
        gradients are in the record) but the parameters' gradients were gone or zeroed when
        ``step()`` read them: ``optimizer.zero_grad()`` called before ``step()`` (their
        ``grad_norm`` absent, or 0; under a GradScaler a skipped step then reads as not
        skipped)."""
        if self._warned_grads or not record.params:
            return
        layer = [v.get("grad_norm") for v in record.layers.values()]
        if not any(g is not None and g > 0 for g in layer):
            return  # no backward through the monitored layers (or all-zero gradients)
        norms = [v.get("grad_norm") for v in record.params.values()]
        if all(g is None for g in norms):
            what = "none of the monitored parameters had a gradient (every .grad was None)"
        elif all(g == 0 for g in norms if g is not None) and all(g is not None for g in norms):
            what = "every monitored parameter's gradient was all zeros"
        else:
            return
        self._warned_grads = True
        warnings.warn(
            f"Monitor: step {record.step}: {what} when step() read them, although the backward "
            "reached the monitored layers (their output gradients are recorded): "
            "optimizer.zero_grad() was called before step()? The record's parameter grad_norm "
            "are absent or 0 (and under a GradScaler a step it skipped reads as not skipped); call "
            "monitor.step(optimizer) after optimizer.step() and before optimizer.zero_grad()",
            MonitorWarning,
            stacklevel=3,
        )

    def _check_layers_ran(self, step: int, scope: HookScope | None) -> None:
        """Warn when a logged step recorded no layer although layers were asked for: the model
        did not run through ``model(...)``, or ran in a thread the step's hooks do not act on."""
        st = self._state
        if scope is None or not self._gate[0] or not self.named:
            return
        if not ("activations" in self.stats or "gradients" in self.stats):
            return
        if st.acts or st.grads or st.counts:
            return
        if scope.thread != get_ident():
            why = (
                "this step's hooks were attached by another thread (the one that created the "
                "Monitor or called the previous step()) than the one calling step(), and hooks act "
                "only on their own thread's calls (docs/guide/core.md, Threads): create the "
                "Monitor in the thread that trains; later steps are recorded"
            )
        elif st.evaluations:
            why = (
                f"the model ran only under torch.no_grad() or torch.inference_mode() "
                f"({st.evaluations} call(s)): an evaluation, which trains nothing, is not "
                "recorded; run the training forward with gradients enabled"
            )
        else:
            why = (
                "was the model called (as model(...), not model.forward(...)) in this thread "
                "before step()?"
            )
        warnings.warn(
            f"step {step}: no monitored layer ran (or none gave a floating-point output) since "
            f"the last step(), so its record has no layer statistics; {why}",
            MonitorWarning,
            stacklevel=3,
        )

    def _inner_optimizer(self, optimizer: Any) -> Any:
        """The torch optimizer behind a wrapper; adopts (with a warning) the wrapper's scaler."""
        scaler = None
        while True:
            scaler = scaler or getattr(optimizer, "scaler", None)
            inner = getattr(optimizer, "optimizer", None)
            if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
                break
            optimizer = inner
        if _enabled(scaler) and self.scaler is None and hasattr(scaler, "get_scale"):
            warnings.warn(
                f"step {self._step}: the optimizer steps through a GradScaler the Monitor was not "
                "given, so this step's output-gradient statistics are multiplied by its scale; "
                "it is used from the next step on. Pass it from the start: "
                "Monitor(model, ..., scaler=accelerator.scaler)",
                MonitorWarning,
                stacklevel=3,
            )
            self.scaler = scaler
        return optimizer

    def _scaled(self, optimizer: Any) -> bool:
        """Are the ``.grad`` still multiplied by the scaler's scale?"""
        scaler, st = self.scaler, self._state
        if not _enabled(scaler):
            return False
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is None:
            return True
        if st.scaler_states is not None and states is not st.scaler_states:
            return False  # update() ran since backward, so step()/unscale_() unscaled the grads
        keys = [id(optimizer)] if optimizer is not None else list(states)
        for k in keys:
            entry = dict.get(states, k)
            if entry is not None and getattr(entry.get("stage"), "value", 0) != 0:
                return False
        return True

    def _record(self, step: int, optimizer: Any) -> MonitorRecord:
        """The step's record: every statistic is filed in one :class:`Packer`, read with one host
        transfer (one ``all_gather`` under torch.distributed), and combined by slot."""
        st, pack = self._state, Packer()
        # one entry per (layer call, micro-batch): micro-batches combine like ranks below;
        # the histogram is the first micro-batch's
        acts = {
            key: (
                [(pack.add_host(n), pack.add(v)) for n, v, _ in entries],
                pack.add(entries[0][2]) if entries[0][2] is not None else None,
            )
            for key, entries in st.acts.items()
        }
        grads = {key: [pack.add(g) for g in gs] for key, gs in st.grads.items()}
        replaced = self._drop_replaced(step) if "parameters" in self.stats else set()
        pslot = self._pack_params(pack)
        late, lslot = self._pack_late_params(pack, step, replaced, optimizer is not None)
        sslot = pack.add(st.scale.double()) if st.scale is not None else None
        scaling = _enabled(self.scaler)
        mine, rest = self._pack_skip_check(pack, optimizer, pslot) if scaling else ([], None)
        # a parameter frozen during the step keeps a stale .grad (zero_grad(set_to_none=False))
        has = [p.grad is not None and p.requires_grad for _, p in self._params]
        if not len(pack) and not (self.stats and _world() > 1):
            return MonitorRecord(step)
        # under torch.distributed a rank with nothing to file gathers too: it skipped the
        # collective, and the others joined their record with its next step's
        layout = _layout(acts, grads, self._params, late, sslot, rest) if _world() > 1 else ""
        got = pack.gather(step, layout)
        scale = (got.read(sslot)[0] or 1.0) if sslot is not None else 1.0
        layers, hists, sums = self._layer_values(got, acts, grads, scale)
        params = self._param_values(got, pslot, has, scale, optimizer)
        if lslot is not None:
            params.update(self._late_values(got, lslot, late, scale, optimizer))
        skipped = None
        if scaling:  # a GradScaler skips the step when a gradient is not finite
            norms = [params[n].get("grad_norm", 0.0) for n in mine]
            if rest is not None:
                norms += [v for r in got.each(rest) for v in r]
            skipped = not all(math.isfinite(v) for v in norms)
        rec = MonitorRecord(
            step, layers, params, histograms=hists, skipped=skipped, histogram_sums=sums
        )
        rec.alerts = diagnose(
            step, layers, params, self._prev, self.thresholds, self._allowed, skipped
        )
        self._prev = (layers, params)
        return rec

    def _pack_params(self, pack: Packer) -> int | None:
        """File the parameters' ``[grad, weight, update, before]`` norms; their slot."""
        if not self._params:
            return None
        if self._sharded:
            return pack.add(sharded_param_sumsq(self._params, self._before))
        ws = [p for _, p in self._params]
        return pack.add(param_stats(ws, [p.grad for p in ws], self._before))

    def _drop_replaced(self, step: int) -> set[str]:
        """Parameters replaced (``model.fc.weight = nn.Parameter(...)``), resized
        (``p.data = ...`` of another shape) or removed since this step's weights were copied:
        the copy does not compare with the values after the step, so no update ratio can be
        computed; they leave this step's list (a replaced or resized one is recorded with the
        parameters unfrozen during the step, without an update ratio), said once per parameter.
        Returns the names replaced or resized."""
        self._all_params = self._select_params()
        now = dict(self._all_params)
        keep = [j for j, (n, p) in enumerate(self._params) if now.get(n) is p]
        resized: list[str] = []
        if self._before is not None:  # the same tensor given other values (p.data = ...)
            ws = local_tensors([self._params[j][1] for j in keep])
            same = [w.shape == self._before[j].shape for j, w in zip(keep, ws)]
            resized = [self._params[j][0] for j, ok in zip(keep, same) if not ok]
            keep = [j for j, ok in zip(keep, same) if ok]
        if len(keep) == len(self._params):
            return set()
        names = [n for j, (n, _) in enumerate(self._params) if j not in set(keep)]
        if self._before is not None:
            self._before = [self._before[j] for j in keep]
        self._params = [self._params[j] for j in keep]
        self._sharded = any_sharded(self._params)
        replaced = [n for n in names if n in now and n not in resized]
        gone = [n for n in names if n not in now]
        if resized:
            self._say(
                "resized",
                resized,
                f"step {step}: parameter(s) {{}} changed shape during the step (p.data = ...) "
                "after the monitor copied their values before the step: this record has their "
                "gradient and weight norms but no update_ratio (the values before and after "
                "do not compare); the next logged steps have it",
            )
        if replaced:
            self._say(
                "replaced",
                replaced,
                f"step {step}: parameter(s) {{}} replaced by another tensor during the step "
                "(model.<layer>.<name> = nn.Parameter(...)) after the monitor copied their "
                "values before the step: this record has the new parameter's gradient and "
                "weight norms but no update_ratio (the value before the step was the old "
                "tensor's); the next logged steps have it. An optimizer made before the "
                "replacement still holds the old tensor and does not step the new one",
            )
        if gone:
            self._say(
                "removed",
                gone,
                f"step {step}: parameter(s) {{}} are no longer parameters of the monitored layers "
                "(removed, or their module replaced: a module put in the model after the "
                "Monitor was made is not monitored; make a new Monitor): not recorded",
            )
        return set(replaced) | set(resized)

    def _say(self, kind: str, names: list[str], message: str) -> None:
        """Warn, once per parameter and kind, that a record leaves something out."""
        new = [n for n in names if (kind, n) not in self._said]
        if not new:
            return
        self._said.update((kind, n) for n in new)
        warnings.warn("Monitor: " + message.format(some_names(new)), MonitorWarning, stacklevel=5)

    def _pack_late_params(
        self, pack: Packer, step: int, replaced: set[str], ratios: bool
    ) -> tuple[list[tuple[str, nn.Parameter]], int | None]:
        """Parameters unfrozen (or replaced) since this step's hooks were attached (no weight
        snapshot: no update ratio, said once per parameter): their gradient and weight norms,
        filed; ``(params, slot)``."""
        ids = {id(p) for _, p in self._params}
        late = [(n, p) for n, p in self._all_params if p.requires_grad and id(p) not in ids]
        if not late:
            return late, None
        unfrozen = [n for n, _ in late if n not in replaced]
        if unfrozen and ratios:
            self._say(
                "unfrozen",
                unfrozen,
                f"step {step}: parameter(s) {{}} set to train (requires_grad=True) during the "
                "step, after the monitor copied the trained weights' values before it: this "
                "record has their gradient and weight norms but no update_ratio; the next "
                "logged steps have it (unfreeze before the previous monitor.step() to have it "
                "on this one)",
            )
        check_params([(n, p) for n, p in late if id(p) not in self._checked])
        self._checked.update(id(p) for _, p in late)
        if any_sharded(late):
            return late, pack.add(sharded_param_sumsq(late, None))
        return late, pack.add(param_stats([p for _, p in late], [p.grad for _, p in late], None))

    def _late_values(
        self,
        got: Packed,
        slot: int,
        late: list[tuple[str, nn.Parameter]],
        scale: float,
        optimizer: Any,
    ) -> dict[str, dict[str, float]]:
        pscale = scale if self._scaled(optimizer) else 1.0
        row = sum_ranks_sqrt(got.each(slot)) if any_sharded(late) else got.read(slot)
        out: dict[str, dict[str, float]] = {}
        for j, (pname, p) in enumerate(late):
            d = {"grad_norm": row[4 * j] / pscale} if p.grad is not None else {}
            d["weight_norm"] = row[4 * j + 1]
            out[pname] = d
        return out

    def _pack_skip_check(
        self, pack: Packer, optimizer: Any, pslot: int | None
    ) -> tuple[list[str], int | None]:
        """With a GradScaler: did it skip this step? It does when any gradient of the optimizer's
        parameters is not finite. Returns the names of those the monitor reads anyway, and the
        slot of the norms of the others (``None``: no others)."""
        ids = {id(p): n for n, p in self._params} if pslot is not None else {}
        ps = (
            [p for g in optimizer.param_groups for p in g["params"]]
            if optimizer is not None
            else [p for _, p in self._params]
        )
        mine = [ids[id(p)] for p in ps if id(p) in ids]
        rest = [local(p.grad) for p in ps if id(p) not in ids and p.grad is not None]
        if not rest:
            return mine, None
        return mine, pack.add(torch.stack(torch._foreach_norm(rest, 2)).double())

    def _layer_values(
        self,
        got: Packed,
        acts: dict[str, tuple[list[tuple[int, int]], int | None]],
        grads: dict[str, list[int]],
        scale: float,
    ) -> tuple[
        dict[str, dict[str, float]],
        dict[str, tuple[list[float], list[float]]],
        dict[str, tuple[float, float]],
    ]:
        """Per layer call: activation and output-gradient statistics combined over micro-batches
        and ranks; activation histograms (of the first micro-batch, every rank's), and their
        sums where the step had several micro-batches."""
        st, tp = self._state, self._tp
        layers: dict[str, dict[str, float]] = {}
        hists: dict[str, tuple[list[float], list[float]]] = {}
        sums: dict[str, tuple[float, float]] = {}
        first = next(iter(acts), None)
        for key, (micro, hslot) in acts.items():
            ns: list[float] = []
            vs: list[list[float]] = []
            for nslot, vslot in micro:  # each micro-batch: its per-rank pieces
                ns_k, vs_k = [r[0] for r in got.each(nslot)], got.each(vslot)
                if tp:  # the same batch on every rank: replicated or sharded outputs
                    ns_k, vs_k = tp_pieces(ns_k, vs_k, st.kinds.get(key) == "replicate", tp[1])
                elif key == first and len(set(ns_k)) > 1 and (grads or self._params):
                    self._unequal_shares(key, ns_k)  # the first layer to run: the batch's share
                ns += ns_k
                vs += vs_k
            layers[key] = combine_acts(ns, vs)
            if hslot is not None:  # the first micro-batch's histogram over [-absmax, absmax]
                if len(micro) > 1 and not self._warned_hist_micro:
                    self._warned_hist_micro = True
                    warnings.warn(
                        f"Monitor: step {self._step} ran {len(micro)} micro-batches (layer "
                        f"{key!r}); its activation histograms are of the first micro-batch "
                        "only (binned while it ran, over its own absmax: the later ones were "
                        "not yet known), while the other statistics cover every micro-batch",
                        MonitorWarning,
                        stacklevel=4,
                    )
                a, counts = self._histogram(got, key, micro[0][1], hslot)
                edges = [a * (-1 + 2 * (j + 1) / len(counts)) for j in range(len(counts))]
                hists[f"activations/{key}"] = (edges, counts)
                if len(micro) > 1:  # the binned values' sums: the first micro-batch's
                    sums[f"activations/{key}"] = self._first_sums(got, key, micro[0])
        # Under torch.distributed the ranks' losses are averaged (what DDP optimises), so each
        # rank's output gradient is divided by the world size: the same values as one process
        # running the combined batch.
        # (Tensor parallel: one batch per data-parallel group, averaged over those groups only;
        # output gradients replicated or sharded.)
        # Micro-batches are not divided: a loop that accumulates divides each micro-batch's loss
        # by their number itself (the mean over the combined batch).
        gscale = scale * (tp[0] if tp else got.world)
        for key, slots in grads.items():
            gs = []
            for slot in slots:
                gs_k = got.each(slot)
                if tp:
                    replicated = st.kinds.get(key) == "replicate"
                    gs_k = tp_pieces([0.0] * len(gs_k), gs_k, replicated, tp[1])[1]
                gs += gs_k
            layers.setdefault(key, {}).update(combine_grads(gs, gscale))
        return layers, hists, sums

    def _first_sums(self, got: Packed, key: str, first: tuple[int, int]) -> tuple[float, float]:
        """``(sum, sum of squares)`` of a layer call's first micro-batch over the ranks (the
        values its histogram binned), from its count, mean and std."""
        nslot, vslot = first
        ns, vs = [r[0] for r in got.each(nslot)], got.each(vslot)
        if self._tp:
            replicated = self._state.kinds.get(key) == "replicate"
            ns, vs = tp_pieces(ns, vs, replicated, self._tp[1])
        m = combine_acts(ns, vs)
        n = sum(ns)
        std = m["std"] if n > 1 else 0.0
        return m["mean"] * n, std**2 * (n - 1) + n * m["mean"] ** 2

    def _histogram(
        self, got: Packed, key: str, vslot: int, hslot: int
    ) -> tuple[float, list[float]]:
        """A layer call's histogram of its first micro-batch: ``(absmax, counts)``. Under
        torch.distributed every rank binned over the ranks' largest ``absmax``
        (``ranks_absmax``), so the counts add up: those of one process on the combined batch
        (tensor parallel: a replicated output counted once per data-parallel group, the shards
        of a sharded one added, as the other statistics)."""
        if got.world == 1:
            return got.read(vslot)[2], got.read(hslot)
        each = got.each(hslot)
        if self._tp is not None:
            replicated = self._state.kinds.get(key) == "replicate"
            each = tp_pieces([0.0] * len(each), each, replicated, self._tp[1])[1]
        ams = [r[2] for r in got.each(vslot)]
        a = math.nan if any(math.isnan(v) for v in ams) else max(ams)
        return a, [sum(c) for c in zip(*each)]

    def _unequal_shares(self, layer: str, counts: list[float]) -> None:
        """Warn (once) that the ranks ran unequal shares of the batch: DDP (FSDP2) averages the
        ranks' losses, so with a mean loss the gradients weigh a row of a smaller share more
        than one process on the combined batch would (activation statistics, combined by counts,
        are the combined batch's)."""
        if self._warned_shares:
            return
        self._warned_shares = True
        shares = [int(c) for c in counts]
        warnings.warn(
            f"Monitor: the ranks ran unequal batch shares this step (layer {layer!r}, the first "
            f"to run, saw {shares} values on ranks 0-{len(shares) - 1}): DDP and FSDP2 average the ranks' "
            "losses, so the gradient statistics and parameter gradient norms are those of that "
            "average, not of one process on the combined batch (with a mean loss a row of a "
            "smaller share weighs more); the activation statistics are the combined batch's. "
            "Give every rank equal shares (DistributedSampler(drop_last=True), a DataLoader "
            "with drop_last=True)",
            MonitorWarning,
            stacklevel=4,
        )

    def _param_values(
        self, got: Packed, pslot: int | None, has: list[bool], scale: float, optimizer: Any
    ) -> dict[str, dict[str, float]]:
        """Per parameter: gradient norm (unscaled), weight norm, update-to-weight ratio."""
        params: dict[str, dict[str, float]] = {}
        if pslot is None:
            return params
        pscale = scale if self._scaled(optimizer) else 1.0
        row = (  # full-tensor norms from every rank's shards; DDP: the same on every rank
            sum_ranks_sqrt(got.each(pslot)) if self._sharded else got.read(pslot)
        )
        stepped = (
            {id(p) for g in optimizer.param_groups for p in g["params"]}
            if optimizer is not None and self._before is not None
            else None
        )
        idle = []  # trained (a gradient), unchanged, and not the optimizer's: it never trains
        for j, (pname, p) in enumerate(self._params):
            gn, wn, un, bn = row[4 * j : 4 * j + 4]
            d = {}
            if has[j]:  # a NaN gradient is reported as NaN, never as "no gradient"
                d["grad_norm"] = gn / pscale
            d["weight_norm"] = wn
            if stepped is not None:
                d["update_ratio"] = un / bn if bn > 0 else (0.0 if un == 0 else math.inf)
                if has[j] and un == 0 and id(p) not in stepped:
                    idle.append(pname)
            params[pname] = d
        if idle:
            self._say(
                "idle",
                idle,
                f"step {self._step}: parameter(s) {{}} have a gradient but are not among the "
                "parameters of the optimizer given to monitor.step(), and did not change this "
                "step (update_ratio 0): held by no optimizer, they never train (an optimizer "
                "made before they were unfrozen or replaced? optimizer.add_param_group("
                "{{'params': [...]}}); another optimizer stepping them after monitor.step()? "
                "call it after both)",
            )
        return params

    def _sentinel_check(self, logged: bool) -> NonFiniteOrigin | None:
        tracker = self._tracker
        assert tracker is not None
        grads = [p.grad for _, p in self._sentinel_params() if p.grad is not None]
        # 2-norms: NaN if any NaN, inf if any inf (the fastest foreach reduction on CPU)
        # (local shards of DTensor gradients: the rank holding a NaN reports it)
        extra = [torch.stack(torch._foreach_norm(local_tensors(grads), 2))] if grads else []
        origin, ext = tracker.locate(extra)
        own = origin is not None  # found in this rank's module graph
        if (
            origin is not None
            and origin.phase == "backward"
            and origin.kind == "inf"
            and self.scaler is not None
        ):
            origin = None  # a GradScaler overflow: the scaler skips this step and lowers its scale
        if (
            origin is None
            and ext
            and self.scaler is None
            and not all(math.isfinite(v) for v in ext[0])
        ):
            # nothing in the module graph: the first layer (in backward order) whose own
            # parameter gradient is non-finite, e.g. the first layer of a model whose input
            # does not require grad
            named = [(n, p) for n, p in self._sentinel_params() if p.grad is not None]
            bad = [(n, v) for (n, _), v in zip(named, ext[0]) if not math.isfinite(v)]
            pname, v = bad[-1]
            layer = pname.rpartition(".")[0]
            origin = NonFiniteOrigin(
                layer,
                "backward",
                0,
                "nan" if math.isnan(v) else "inf",
                tracker.types.get(layer, ""),
                {"param_grad_absmax": v},
            )
        # modules the sentinel no longer sees (replaced, added, hooks hs.remove_hooks took):
        # asked at a logged step, when an origin was found, or when hooks were taken (one set
        # read on the other steps); said, and the sentinel hooks the model anew
        lost = (
            tracker.lost(added=origin is not None)
            if logged or origin is not None or tracker.scope.stripped
            else None
        )
        if lost:
            self._sentinel_lost(lost, origin)
            tracker.scope.remove()
            self._tracker = self._new_tracker()
        else:
            tracker.reset()
        # distributed: a NaN another rank made arrives here through the gradient reduction
        origin, self._origin_rank = origin_across_ranks(origin, own, self._reduced, self._step)
        if origin is not None and self.nonfinite is None:
            self.nonfinite = origin
        return origin

    def _sentinel_lost(self, lost: dict[str, str], origin: NonFiniteOrigin | None) -> None:
        """Warn that the sentinel missed the calls of ``lost`` (``{layer: what happened}``) in
        this step: a NaN/Inf made there is blamed on the layer that called them, so ``origin``
        (when one was found) may be wrong; it watches the model as it is now from the next
        step (the caller hooks it anew)."""
        taken = [n for n, v in lost.items() if v.endswith("hs.remove_hooks")]
        moved = [n for n in lost if n not in taken]
        what, fix = [], []
        if moved:
            first = lost[moved[0]]
            change = (
                "adding"
                if "was added" in first
                else ("removing" if first.endswith("no longer in the model") else "replacing")
            )
            what.append(
                f"layer(s) {some_names(moved)} changed in the model while the Monitor's sentinel "
                f"watched it ({first})"
            )
            fix.append(f"create the Monitor after {change} {attribute_path(moved[0])}")
        if taken:
            what.append(
                f"the sentinel's hooks on {len(taken)} layer(s) "
                f"({some_names([n or '<root>' for n in taken])}) were removed by "
                "hs.remove_hooks(...)"
            )
            fix.append("keep hs.remove_hooks for scopes that were never closed")
        if origin is None:
            said = "a NaN/Inf made there is blamed on the layer that called them"
            if taken:
                said = "a NaN/Inf made after that was not looked for"
        else:
            where = (
                origin.layer
                if origin.layer in (NonFiniteOrigin.INPUT, NonFiniteOrigin.LOSS)
                else f"layer {origin.layer or '<root>'!r} ({origin.module_type})"
            )
            said = (
                f"the NaN/Inf origin found ({where}, {origin.phase} pass) may be wrong: one "
                "made there is blamed on the layer that called them, or on a later layer"
            )
        warnings.warn(
            f"step {self._step}: {'; '.join(what)}, so the sentinel did not see their calls in "
            f"this step ({said}); it watches the model as it is now from the next step on "
            f"({'; '.join(fix)})",
            MonitorWarning,
            stacklevel=4,
        )

    def _sentinel_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in named_parameters(self.model) if p.requires_grad]

    # -- output ----------------------------------------------------------------------------------
    def _emit(self, record: MonitorRecord, *, write: bool) -> None:
        rank = _rank()
        # statistics are reduced across ranks, so only rank 0 reports them; a NaN origin is
        # that of the rank that saw it in its own module graph (origin_across_ranks), on every rank
        messages = [(MonitorWarning, a.message) for a in record.alerts] if rank == 0 else []
        if record.nonfinite is not None:
            seen = rank if self._origin_rank is None else self._origin_rank
            where = f" (rank {seen})" if dist.is_available() and dist.is_initialized() else ""
            messages.insert(0, (NonFiniteWarning, f"step {record.step}{where}: {record.nonfinite}"))
        failed: BaseException | None = None
        if write:
            self.records.append(record)
            if rank == 0:
                for sink in self.sinks:
                    try:  # one failing sink must not keep the record from the others
                        sink(record)
                    except Exception as e:
                        if failed is None:
                            e.add_note(
                                f"hookscope: the monitor sink {_sink_name(sink)} raised on step "
                                f"{record.step}; the record is in monitor.records and reached "
                                "the other sinks, and the next steps are recorded as usual"
                            )
                            failed = e
                        else:  # raised after the first: named on the error that is raised
                            failed.add_note(
                                f"hookscope: the monitor sink {_sink_name(sink)} raised too on "
                                f"step {record.step}: {_error_line(e)}"
                            )
        for cls, msg in messages:
            if self.alerts in ("warn", "both"):
                warnings.warn(msg, cls, stacklevel=3)
            if self.alerts in ("log", "both"):
                log.warning(msg)
        if failed is not None:
            raise failed

    def plot(self, path: Any = None, **kwargs: Any) -> Any:
        """Gradient-flow plot of the records (see :func:`plot_grad_flow`); saved when ``path``."""
        from ._plot import plot_grad_flow

        return plot_grad_flow(list(self.records), path, **kwargs)

    def close(self) -> None:
        """Remove every hook and close the sinks. Safe to call several times."""
        self._closed = True
        self._detach()
        if self._tracker is not None:
            self._tracker.scope.remove()
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        self.sinks = []

    remove = close

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Monitor:
        enter_once(self, "Monitor", not self._closed)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Monitor {len(self.named)} layers, every={self.every}, step {self._step}, {len(self.records)} records>"


def _check_arguments(
    every: Any,
    stats: tuple[Any, ...],
    alerts: Any,
    histograms: Any,
    keep: Any,
    sentinel: Any,
    first_step: Any = 0,
) -> None:
    """Refuse, before anything is attached, arguments that would give empty or meaningless records."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(every) or every < 1:
        raise ValueError(f"every must be a positive int (1: every step), got {every!r}")
    if not is_int(first_step) or first_step < 0:
        raise ValueError(
            f"first_step must be an int >= 0 (the steps already taken), got {first_step!r}"
        )
    if not isinstance(sentinel, bool):
        raise ValueError(f"sentinel must be True or False, got {sentinel!r}")
    if not stats and not sentinel:
        raise ValueError(
            f"stats: no group chosen, so every record would be empty; choose one or more of "
            f"{list(_GROUPS)} (or sentinel=True to record only where a NaN/Inf starts)"
        )
    bad = [s for s in stats if s not in _GROUPS]
    if bad:
        raise ValueError(f"unknown stats group(s) {bad}; valid: {list(_GROUPS)}")
    if alerts not in ("warn", "log", "both", "off"):
        raise ValueError(f"alerts must be 'warn', 'log', 'both' or 'off', got {alerts!r}")
    if not is_int(histograms) or histograms < 0:
        raise ValueError(f"histograms must be an int >= 0 (bins; 0: none), got {histograms!r}")
    if keep is not None and (not is_int(keep) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1 (records kept), got {keep!r}")


def _error_line(e: BaseException) -> str:
    """``Type: message (file:line)`` of an error, where it was raised."""
    where = ""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    return f"{type(e).__name__}: {e}{where}"


def _sink_name(sink: Any) -> str:
    """A sink as a user would name it: the function, or the class of a bound ``write``."""
    owner = getattr(sink, "__self__", None)
    if owner is not None:
        return type(owner).__name__
    return getattr(sink, "__qualname__", None) or type(sink).__name__


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _layout(
    acts: Mapping[str, tuple[list[Any], int | None]],
    grads: Mapping[str, list[int]],
    params: list[tuple[str, nn.Parameter]],
    late: list[tuple[str, nn.Parameter]],
    sslot: int | None,
    rest: int | None,
) -> str:
    """What a step filed, in order (layer calls with their micro-batch counts and histograms,
    gradient entries, parameters): equal on every rank, or their records do not join."""
    return " ".join(
        [f"{k}x{len(m)}{'h' if h is not None else ''}" for k, (m, h) in acts.items()]
        + [f"g:{k}x{len(v)}" for k, v in grads.items()]
        + [f"p:{n}" for n, _ in params]
        + [f"late:{n}" for n, _ in late]
        + (["scale"] if sslot is not None else [])
        + (["rest"] if rest is not None else [])
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _enabled(scaler: Any) -> bool:
    """Is ``scaler`` a GradScaler that scales (``GradScaler(enabled=False)`` does not)?"""
    return scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled())


def _refuse_fsdp1(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    params: list[tuple[str, nn.Parameter]],
) -> None:
    """FSDP1 parameters are flat shards the monitor cannot reduce to full-tensor norms: say so
    at creation, instead of recording no parameters or the norms of one rank's slices. Found by
    the wrapper in the model, or (a model given without its wrapper, as trainers hand callbacks
    the unwrapped module) by what FSDP1 leaves on the parameters: its mark
    (:func:`fsdp1_marked`, ``use_orig_params=True``), or a ``weight``/``bias`` that is no longer
    a registered parameter but a plain tensor view (``use_orig_params=False``)."""
    found = [w or "<root>" for w in fsdp1_wrappers(model)]
    what = "the model is wrapped in FSDP1 FullyShardedDataParallel"
    if not found:
        found = fsdp1_marked(params)
        what = "parameters are managed by FSDP1 FullyShardedDataParallel"
    if not found and fsdp1_loaded() and dist.is_available() and dist.is_initialized():
        # (only then: old-style torch.nn.utils.weight_norm also leaves a plain-tensor weight)
        found = [
            f"{name}.{attr}" if name else attr
            for name, m in layers.items()
            for attr in ("weight", "bias")
            if isinstance(m.__dict__.get(attr), torch.Tensor)
        ]
        what = "layer weights are plain tensors, not parameters (FSDP1, use_orig_params=False?)"
    if not found:
        return
    raise UnsupportedTensorError(
        f"{what} ({some_names(found)}): FSDP1 keeps parameters as flat shards, so parameter "
        "statistics would be missing (use_orig_params=False) or those of this rank's slice "
        f"(use_orig_params=True). {FSDP2_INSTEAD}, or record the layers only: "
        "Monitor(model, stats=('activations', 'gradients'))"
    )
