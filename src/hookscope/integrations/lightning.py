"""hookscope's :class:`~hookscope.Monitor` as a PyTorch Lightning callback.

One record per **optimizer step**: with ``accumulate_grad_batches=k`` a record's layer statistics
cover the ``k`` micro-batches of the step and its parameter gradients are the accumulated ones
(read after ``optimizer.step()``, before Lightning zeroes them at the next step's first
micro-batch), clipped with ``gradient_clip_val`` (a warning says so), unscaled under
``precision="16-mixed"`` (a step its GradScaler skips has
``record.skipped``; on the CPU, where Lightning turns the flag into bf16, pass
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]``). A
training batch that steps several optimizers (manual optimization, a GAN) makes one record, read
after the last step (a warning says so). Under manual optimization a record's parameter
gradients are those the optimizer step used, even where ``training_step`` zeroes them right
after ``opt.step()`` (``zero_grad(set_to_none=False)`` there: a warning says the record
holds zeros). The sentinel (``sentinel=True``) names the first layer to produce a NaN/Inf and the step, in
``record.nonfinite`` and a ``NonFiniteWarning``. Forward passes between steps (validation,
the sanity check) are not recorded. Records go to every logger of the trainer
(``Logger.log_metrics``: CSV, TensorBoard, W&B, MLflow, ...) at the record's step, which is
the step Lightning logs the run's own values at (a resumed run goes on from the checkpoint's), and
to the monitor's own sinks; under DDP statistics are reduced across ranks and rank 0 writes.

Example:
    >>> import torch, torch.nn as nn, torch.nn.functional as F, lightning as L
    >>> from hookscope.integrations.lightning import HookscopeCallback
    >>> class Net(L.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ...     def training_step(self, batch, i):
    ...         x, y = batch
    ...         return F.cross_entropy(self.net(x), y)
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    >>> cb = HookscopeCallback(every=1, alerts="off")
    >>> trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[cb], logger=False,
    ...                     enable_progress_bar=False, enable_model_summary=False,
    ...                     enable_checkpointing=False)
    >>> trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))  # doctest: +SKIP
    >>> [r.step for r in cb.records]  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import warnings
from typing import Any

from ..core._errors import HookscopeWarning, UnsupportedModelError
from ..monitor import Monitor, MonitorRecord, MonitorWarning
from ._common import need

_pl = need("lightning.pytorch", "lightning")

__all__ = ["HookscopeCallback"]


class HookscopeCallback(_pl.Callback):  # type: ignore[misc, name-defined]
    """A Lightning ``Callback`` that owns a :class:`~hookscope.Monitor` of the ``LightningModule``.

    Args:
        layers: what to watch (see :func:`hookscope.find`); default every leaf module.
        log_to_loggers: also send each record's scalars (:meth:`MonitorRecord.scalars`) to the
            trainer's loggers.
        prefix: the scalars' name prefix.
        **monitor_kwargs: the other :class:`~hookscope.Monitor` arguments (``every``, ``stats``,
            ``sinks``, ``sentinel``, ``thresholds``, ``alerts``, ...); ``scaler`` is taken from
            the trainer's precision plugin.
    """

    def __init__(
        self,
        layers: Any = None,
        *,
        log_to_loggers: bool = True,
        prefix: str = "hookscope",
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__()
        if "scaler" in monitor_kwargs:
            raise TypeError("HookscopeCallback takes the GradScaler from the trainer; drop scaler=")
        self.layers, self.log_to_loggers, self.prefix = layers, log_to_loggers, prefix
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self._stepped: Any = None
        self._steps_in_batch = 0
        self._said_steps = False
        # manual optimization: {id(p): (p, the .grad its step used, that tensor's version)}
        self._used: dict[int, tuple[Any, Any, int]] = {}
        self._said_changed = False

    @property
    def records(self) -> list[MonitorRecord]:
        """The records so far (``monitor.records``)."""
        return list(self.monitor.records) if self.monitor is not None else []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after the sanity check: its validation batches are not training statistics
        kw = dict(self.monitor_kwargs)
        sinks = kw.pop("sinks", ())
        sinks = [sinks] if callable(sinks) or hasattr(sinks, "write") else list(sinks)
        if self.log_to_loggers and trainer.loggers:
            sinks.append(_LoggerSink(trainer, self.prefix))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        clip = getattr(trainer, "gradient_clip_val", None)
        if (
            clip
            and "parameters" in kw.get("stats", ("parameters",))
            and getattr(pl_module, "automatic_optimization", True)
        ):
            warnings.warn(
                f"Trainer(gradient_clip_val={clip}): Lightning clips the gradients after "
                "on_before_optimizer_step, so the records' parameter grad_norm are those of the "
                "clipped gradients the optimizer used (exploding alerts cannot fire on them); "
                "layer output-gradient statistics are not clipped. To see the gradients backward "
                "gave, train without clipping while diagnosing, or log "
                "lightning.pytorch.utilities.grad_norm in on_before_optimizer_step",
                HookscopeWarning,
                stacklevel=2,
            )
        kw.setdefault("first_step", _logged_step(trainer))
        try:
            self.monitor = Monitor(pl_module, self.layers, sinks=sinks, scaler=scaler, **kw)
        except UnsupportedModelError as e:
            if getattr(pl_module, "_compiler_ctx", None) is None:
                raise
            # trainer.fit(torch.compile(module)): Lightning compiles the module's forward and
            # training_step as functions, which run no hook added to the modules they call
            raise UnsupportedModelError(
                f"trainer.fit(torch.compile({type(pl_module).__name__}(...))): Lightning "
                "compiles the LightningModule's forward and training_step as functions, whose "
                "compiled code runs no hook added to the modules they call, so the callback "
                "cannot record them; compile the network inside the module instead "
                "(self.net = torch.compile(self.net), or self.net.compile(), in __init__ or "
                "configure_model) and pass the module uncompiled to trainer.fit"
            ) from e

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is not None:
            self.monitor.resume()
            self.monitor.micro_batch()  # training_step may call sub-modules, not the module

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepped = optimizer  # only on the micro-batch that ends an optimizer step
        self._steps_in_batch += 1
        mon = self.monitor
        if (
            mon is not None
            and not getattr(pl_module, "automatic_optimization", True)
            and (mon.step_index % mon.every == 0 or self.monitor_kwargs.get("sentinel"))
        ):
            # manual optimization: training_step may zero the gradients right after opt.step()
            # (Lightning's own accumulation example does), before the record is read at the
            # batch's end: keep the gradients this step uses (references, no copy)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is not None:
                        self._used[id(p)] = (p, g, g._version)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        if self._stepped is not None:
            optimizer, self._stepped = self._stepped, None
            n, self._steps_in_batch = self._steps_in_batch, 0
            if n > 1 and not self._said_steps:
                self._said_steps = True
                warnings.warn(
                    f"batch {batch_idx}: {n} optimizer steps in one training batch (manual "
                    "optimization: several optimizers, a GAN, or one stepped several times); "
                    "the callback makes one record per batch, read after the last step, so the "
                    "parameters an earlier optimizer stepped show the gradients .grad holds "
                    "then (every backward since their zero_grad), and the layer statistics "
                    "cover every forward of the batch. To record each optimizer step, call "
                    "hs.Monitor's step(optimizer) yourself in training_step",
                    HookscopeWarning,
                    stacklevel=2,
                )
            used, self._used = self._used, {}
            gone = self._restore_grads(used, n, batch_idx) if used else []
            try:
                self.monitor.step(optimizer)  # reads through LightningOptimizer
            finally:
                for p in gone:
                    p.grad = None
        self.monitor.pause()  # until the next training batch: validation is not recorded

    def _restore_grads(
        self, used: dict[int, tuple[Any, Any, int]], steps: int, batch_idx: int
    ) -> list[Any]:
        """Manual optimization: give back, for the record, the gradients an optimizer step of
        this batch used and ``training_step`` set to ``None`` after it (``opt.zero_grad()``
        after ``opt.step()``: the records had no parameter ``grad_norm``, silently); warn when
        one was changed in place since (``zero_grad(set_to_none=False)``: a ``grad_norm`` of 0).
        Returns the parameters given back (their ``.grad`` goes back to ``None`` after)."""
        gone, changed = [], []
        for p, g, version in used.values():
            if p.grad is None:
                p.grad = g
                gone.append(p)
            elif p.grad is g and g._version != version and steps == 1:
                changed.append(p)
        if changed and not self._said_changed:
            self._said_changed = True
            # (the monitor's own warning of gradients read as zeros says the same, less exactly)
            self.monitor._warned_grads = True  # type: ignore[union-attr]
            names = {id(p): n for n, p in self.monitor.model.named_parameters()}  # type: ignore[union-attr]
            which = [names.get(id(p), "?") for p in changed]
            shown = ", ".join(repr(n) for n in which[:3]) + (", ..." if len(which) > 3 else "")
            warnings.warn(
                f"batch {batch_idx}: the gradients of parameter(s) {shown} were changed in place "
                "after the optimizer step that used them (opt.zero_grad(set_to_none=False) after "
                "opt.step() in training_step?), before the callback reads them at the end of the "
                "training batch: the records' parameter grad_norm are of the changed values (0 "
                "after a zero_grad), not the ones the step used. Call opt.zero_grad() with "
                "set_to_none=True (the default), or before manual_backward",
                MonitorWarning,
                stacklevel=2,
            )
        return gone

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _logged_step(trainer: Any) -> int:
    """The step Lightning logs the coming optimizer step's values at (its loggers' step: the
    batches that stepped, restored from a checkpoint on resume; not ``global_step``, which
    counts each optimizer of a step)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) else int(trainer.global_step)


class _LoggerSink:
    """Send a record's scalars to every logger of a trainer (weakly: no cycle through it)."""

    def __init__(self, trainer: Any, prefix: str) -> None:
        import weakref

        self._trainer = weakref.ref(trainer)
        self.prefix = prefix

    def __call__(self, record: MonitorRecord) -> None:
        trainer = self._trainer()
        if trainer is None:
            return
        scalars = record.scalars(self.prefix)
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=record.step)
