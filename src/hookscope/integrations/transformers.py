"""hookscope's :class:`~hookscope.Monitor` as a Hugging Face ``TrainerCallback``.

One record per **optimizer step**: with ``gradient_accumulation_steps=k`` a record's layer
statistics cover the ``k`` micro-batches and its parameter gradients are the accumulated ones,
read in ``on_optimizer_step`` (after ``optimizer.step()``, before the Trainer zeroes them: at
``on_step_end`` they are already gone), so clipped with ``max_grad_norm`` (1.0 by default; a
warning says so: the Trainer's own ``grad_norm`` log is the total before clipping). Evaluation and saving between steps are not recorded.
A record's step is the index of its optimizer step in the run (``state.global_step`` before the
step: a resumed run goes on from the checkpoint's); ``trainer.log`` logs it at the Trainer's step,
``state.global_step`` after the step, one more, as the Trainer logs its own loss.
Given the ``Trainer``, each record is also passed to ``trainer.log``, so it reaches every
``report_to`` integration (TensorBoard, W&B, MLflow, ...), every other callback's ``on_log`` and
``trainer.state.log_history``, but not the console: the Trainer's ``PrinterCallback`` and
``ProgressCallback`` print every value of every log, hundreds per record (``console=True``
prints them). ``log_history`` is saved in ``trainer_state.json`` at every checkpoint: a record
holds a few scalars per watched layer and parameter, so a long run with ``every=1`` makes that
file large; ``log_history=False`` keeps the records out of it (they still reach ``report_to``).

With ``fp16`` the Trainer measures the gradient norm before each optimizer step
(``clip_grad_norm_``), which on a step the GradScaler skips multiplies every gradient by
inf/inf = NaN: that step's record has NaN ``grad_norm`` values and ``skipped=True``.

Example:
    >>> from hookscope.integrations.transformers import HookscopeTrainerCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds)  # doctest: +SKIP
    >>> trainer.add_callback(HookscopeTrainerCallback(trainer, every=10))  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from ..core._compiled import is_optimized, strip_compiled
from ..core._errors import HookscopeWarning
from ..monitor import Monitor, MonitorRecord
from ._common import need

_tf = need("transformers", "transformers")

__all__ = ["HookscopeTrainerCallback"]


class HookscopeTrainerCallback(_tf.TrainerCallback):  # type: ignore[misc, name-defined]
    """A ``TrainerCallback`` that owns a :class:`~hookscope.Monitor` of the Trainer's model.

    Args:
        trainer: the ``Trainer`` (held weakly), so that records reach its ``report_to``
            integrations through ``trainer.log``; without it they go to the monitor's own sinks
            only, and a warning says so when training starts.
        layers: what to watch (see :func:`hookscope.find`); default every leaf module.
        prefix: the logged scalars' name prefix.
        console: also print each record's scalars through the Trainer's console printers.
        log_history: keep each record in ``trainer.state.log_history`` (and so in every
            checkpoint's ``trainer_state.json``), as ``trainer.log`` does with any log.
        **monitor_kwargs: the other :class:`~hookscope.Monitor` arguments (``every``, ``stats``,
            ``sinks``, ``sentinel``, ``alerts``, ...); ``scaler`` is the Trainer's (fp16).
    """

    def __init__(
        self,
        trainer: Any = None,
        layers: Any = None,
        *,
        prefix: str = "hookscope",
        console: bool = False,
        log_history: bool = True,
        **monitor_kwargs: Any,
    ) -> None:
        if "scaler" in monitor_kwargs:
            raise TypeError("HookscopeTrainerCallback takes the GradScaler from the Trainer")
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self.layers, self.prefix, self.monitor_kwargs = layers, prefix, monitor_kwargs
        self.console, self.log_history = console, log_history
        self.monitor: Monitor | None = None
        self._pending: MonitorRecord | None = None

    @property
    def records(self) -> list[MonitorRecord]:
        """The records so far (``monitor.records``)."""
        return list(self.monitor.records) if self.monitor is not None else []

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            warnings.warn(
                "HookscopeTrainerCallback was made without the Trainer: records go to the "
                "monitor's own sinks only, not to report_to; pass it: "
                "trainer.add_callback(HookscopeTrainerCallback(trainer, ...))",
                HookscopeWarning,
                stacklevel=2,
            )
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if trainer is not None and getattr(args, "fp16", False) and scaler is None:
            warnings.warn(
                "TrainingArguments(fp16=True), but the Trainer's Accelerator has no GradScaler "
                "(on the CPU, Accelerate turns fp16 off without a word): the run and its records "
                "are fp32; use bf16=True on the CPU, or a GPU for fp16",
                HookscopeWarning,
                stacklevel=2,
            )
        clip = getattr(args, "max_grad_norm", None)
        if clip and "parameters" in self.monitor_kwargs.get("stats", ("parameters",)):
            warnings.warn(
                f"TrainingArguments(max_grad_norm={clip}) (1.0 by default): the Trainer clips "
                "the gradients before on_optimizer_step, so the records' parameter grad_norm "
                "are those of the clipped gradients the optimizer used (exploding alerts cannot "
                "fire on them; the Trainer's own logged grad_norm is the total before clipping); "
                "layer output-gradient statistics are not clipped. To record the gradients "
                "backward gave, train with max_grad_norm=0 while diagnosing",
                HookscopeWarning,
                stacklevel=2,
            )
        kw = dict(self.monitor_kwargs)
        # resumed from a checkpoint: number the records from the steps already taken
        kw.setdefault("first_step", int(state.global_step))
        self.monitor = Monitor(_called(trainer, model), self.layers, scaler=scaler, **kw)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is not None:
            self.monitor.resume()

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any
    ) -> None:
        if self.monitor is not None:
            self._pending = self.monitor.step(optimizer)  # reads through AcceleratedOptimizer

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is None:
            return
        self.monitor.pause()  # evaluation and saving until the next step are not recorded
        record, self._pending = self._pending, None
        trainer = self._trainer() if self._trainer is not None else None
        if record is not None and trainer is not None and state.is_world_process_zero:
            # trainer.log clears control.should_log (its on_log does): the Trainer would then
            # skip its own loss log of this step, and under DDP only rank 0 would skip that
            # log's all-gather of the loss, so the other ranks would wait forever
            should_log = control.should_log
            _log(trainer, record.scalars(self.prefix), self.console, self.log_history)
            control.should_log = trainer.control.should_log = should_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _called(trainer: Any, model: Any) -> Any:
    """The object the Trainer calls, where it is ``torch.compile(model)`` (``torch_compile=True``:
    Accelerate's wrapper, which the callbacks are not given): hookscope routes the hooks of a
    compiled model it is given (a hooked variant of the compiled code, the hooks opaque to
    Dynamo) and names its layers as the model's. Given ``model`` itself, the Monitor's hooks sat
    inside the wrapper's compiled code: Dynamo traced hookscope's hook code and recompiled it
    per layer up to its recompile limit (torch's warning), and each step warned that the
    wrapper's code may skip the hooks. Else ``model``."""
    wrapped = getattr(trainer, "model_wrapped", None)
    if wrapped is not None and is_optimized(wrapped) and strip_compiled(wrapped) is model:
        return wrapped
    return model


def _log(trainer: Any, logs: dict[str, float], console: bool, history: bool) -> None:
    """``trainer.log(logs)``; unless ``console``, with the console printers left out of that one
    call (the handler's list of callbacks is swapped for a filtered copy and put back: the loop
    that is running this callback's ``on_step_end`` iterates the original list, untouched);
    unless ``history``, the entry ``trainer.log`` appended to ``log_history`` is taken out."""
    handler = trainer.callback_handler
    callbacks = handler.callbacks
    if not console:
        handler.callbacks = [c for c in callbacks if not isinstance(c, _CONSOLE)]
    history_list = trainer.state.log_history
    before = len(history_list)
    try:
        trainer.log(logs)
    finally:
        handler.callbacks = callbacks
        if not history:
            # trainer.log appends exactly one entry ({**logs, "step": ...}) before on_log
            del history_list[before:]


_CONSOLE = (_tf.PrinterCallback, _tf.ProgressCallback)  # each prints every value of every log
