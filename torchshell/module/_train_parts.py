"""Two parts of :class:`~torchshell.module.JaxModule`'s training (see
:mod:`torchshell.module._parts` for the others):

- :class:`StepPart`: the compiled train step (K steps per call, accumulation windows, the
  NaN guard), compiled beside the state's init on the first batch; which step and how its
  optimizer steps count is the adapter's (``adapter.steps``: :class:`TrainSteps`);
- :class:`TrainLogPart`: what a training step gives back to Lightning: the values logged at
  the logging cadence (to the loggers, ``callback_metrics`` and the progress bar), the
  outputs a user callback reads, and the NaN/Inf check read at those syncs. Which values and
  under which names is the adapter's (``adapter.logs``: :class:`~torchshell.adapters.TrainLogs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

import jaxcore
from torchshell.adapters._logs import OWN, find_lrs, fresh
from torchshell.module._parts import _Shared

__all__ = ["StepPart", "TrainLogPart"]


class StepPart(_Shared):
    def _window_step(self, k: int) -> jaxcore.Step:
        """The K-step program of ``steps_per_call="auto"`` windows (:mod:`._windows`)."""
        return jaxcore.make_train_step(
            self.model_fns,
            self.loss_fn,
            self.optimizer(),
            state_sharding=jaxcore.state_shardings(self._state),
            steps_per_call=k,
            compute_dtype=self._compute_dtype,
            nan_policy=self.nan_policy,
        )

    def _buffer_batch(self, batch: Any) -> dict[str, jax.Array] | None:
        """Keeps the batch; runs the window (its last step's metrics) when one is due."""
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        every = max(int(self.trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]
        if self.windows.take(batch, self.trainer.global_step, every):
            return self._run_window()
        return None

    def _run_window(self) -> dict[str, jax.Array]:
        """Runs the buffered batches: K in one call, or one per call for a short window."""

        self._state, metrics = self.windows.run(
            self._state, self.placement, self._window_step, self._one_step
        )
        self._last_metrics = metrics
        return metrics

    def _window_batch(self, batch: Any) -> tuple[Any, Any, int, int] | None:
        """Collects ``accumulate_grad_batches`` batches; the stacked window when complete."""
        m = self.flags.accumulate
        last = self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        window = self.accumulation.take(batch, m, last, self.adapter.global_rows)
        if window is None:
            return None
        rows_ = self.accumulation.micro_rows[0]
        return self.adapter.stack(window, m), window[0], rows_, len(window)

    def on_train_epoch_end(self) -> None:
        self.accumulation.clear()  # (a window never spans epochs: the last batch closes it)
        self.adapter.logs.train_epoch_end(self)  # (the port's epoch means)

    @property
    def window_k(self) -> int | None:
        """K chosen by ``steps_per_call="auto"`` (``None`` while measuring; 1 when off)."""
        return self.windows.k

    def _windowable(self) -> bool:
        """Whether this run can buffer batches (else K=1, nothing measured)."""
        return (
            self.adapter.supports_windows
            and self.flags.accumulate == 1
            and self.accum_steps == 1
            and jax.process_count() == 1
            and not self._outputs_wanted()  # a callback reads each step's loss
        )

    def _choose_k(self, times: tuple[float, float], jbatch: Any, batch: Any) -> None:
        every = max(int(self.trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]
        flops = getattr(self.compiled.stats, "flops_per_step", None)
        can = not self.adapter.reads_values(jbatch) and "mask" not in batch
        k = self.windows.choose(*times, every, flops) if can else 1
        self.windows.k = k
        self._log_to_loggers({"compile/steps_per_call": float(k)})

    def _one_step(self, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        """One step of a window cut short (K=1 math, one call per batch)."""
        jbatch, one, _ = self.adapter.one_step_view(batch, 1)
        assert self.compiled.train is not None
        with self.adapter.checked(one):
            return self.compiled.train(state, jbatch)  # type: ignore[no-any-return]

    def _step_forward(self, batch: Any, i: int) -> tuple[Any, jax.Array]:
        """The next train step's forward pass on ``batch`` (its micro-batch ``i``) alone."""
        if self.compiled.forward is None:
            self.compiled.forward = jaxcore.make_train_forward(
                self.model_fns,
                self.loss_fn,
                micro=self.flags.accumulate > 1,
                compute_dtype=self._compute_dtype,
                weigh_rows=self.adapter.weigh_rows,
            )
        state = self.init_state(batch)
        return self.compiled.forward(state, self.adapter.sample(batch), np.int32(i))  # type: ignore[no-any-return]

    def _compile_beside_init(self, one: Any, micro: int, jbatch: Any) -> None:
        """The first batch: the state's init program compiles in the background while the
        train step is traced and compiled on the state's shapes (``jaxcore.PendingState``);
        with a warm compile cache the two executables load side by side."""
        self.compiled.pending = self._start_state(one)
        self.adapter.steps.compile_train_step(self, micro, self.compiled.pending.abstract, jbatch)

    def _start_state(self, batch: Any) -> jaxcore.PendingState:
        """The state's init, compiling (``jaxcore.start_train_state``)."""
        return jaxcore.start_train_state(
            self.model_fns,
            self.optimizer(),
            self.adapter.sample(batch),
            seed=self.seed,
            mesh=self.mesh,
            param_shardings=self.shard_fn,
        )


class TrainLogPart(_Shared):
    """The logging cadence and where values go; what is logged, under which names, is the
    adapter's ``logs`` (:class:`~torchshell.adapters._logs.TrainLogs`)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.train_log.batch_started()
        self._align_logger_step()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.adapter.hooks.train_batch_end(self)  # (the port: LearningRateMonitor's lr)
        self.train_log.batch_ended()

    def _align_logger_step(self) -> None:
        """Where Lightning's logger step is set (``adapter.steps``)."""
        self.adapter.steps.align_logger_step(self)

    def _log_step(self) -> int:
        """The logger step of the values of the step that just ran (``adapter.steps``)."""
        return self.adapter.steps.log_step(self)  # type: ignore[no-any-return]

    def _logging_step(self, before: int) -> bool:
        """Whether the step that just ran is a logging step (``adapter.steps``)."""
        return self.adapter.steps.logging_step(self, before)  # type: ignore[no-any-return]

    def _outputs_wanted(self) -> bool:
        """A user callback overrides ``on_train_batch_end``: it may read ``outputs["loss"]``.

        (Lightning's and coreshell's own callbacks never read the outputs.) The model's own
        hooks may too (``adapter.hooks.wants_outputs``: the port's ``on_train_batch_end``).
        """
        if self.adapter.hooks.wants_outputs(self):
            return True
        if self._trainer is None:
            return False
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]
        key = (id(self._trainer), len(callbacks))
        if self._wants_outputs[0] != key:  # once per fit, not step
            wanted = any(
                not type(cb).__module__.startswith(("lightning.", "torchshell."))
                and is_overridden("on_train_batch_end", cb, parent=L.Callback)
                for cb in callbacks
            )
            self._wants_outputs = (key, wanted)
        return self._wants_outputs[1]

    def _outputs(self, metrics: Mapping[str, jax.Array] | None) -> dict[str, torch.Tensor] | None:
        if metrics is None or not self._outputs_wanted():
            return None
        return {"loss": torch.tensor(float(np.ravel(jax.device_get(metrics["loss"]))[-1]))}

    def _log_to_loggers(self, metrics: dict[str, float]) -> None:
        """coreshell's own figures (compile statistics) to the loggers, named under
        ``coreshell/``, at the step of the values they came with."""
        if self._trainer is not None and self.loggers:
            own = {k if k.startswith(OWN) else f"{OWN}{k}": v for k, v in metrics.items()}
            for logger in self.loggers:
                logger.log_metrics(own, step=self._log_step())
            self.trainer.logged_metrics.update({k: torch.tensor(v) for k, v in own.items()})

    def _queue_log(self, metrics: dict[str, jax.Array], rows: int) -> None:
        assert self.state is not None
        logs = self.adapter.logs
        extra: dict[str, Any] = {
            f"{logs.own_train}lr": lr for lr in find_lrs(self.state.opt_state).values()
        }
        if self.nan_policy != "none":
            extra[f"{logs.own_train}nonfinite_steps"] = self.state.nonfinite
        values = {**logs.train_values(self, metrics), **fresh(extra)}  # copies: donated state
        self.train_log.queue(values, rows, self._log_step(), self.trainer.current_epoch)

    def _emit(
        self, logs: dict[str, float], step: int, progress_bar: bool, epoch: int | None = None
    ) -> None:
        """One logging step's host values (``TrainLog``'s callback), as the adapter's ``logs``
        emit them (which of them, under which names: through :meth:`_log_values`)."""
        self.adapter.logs.emit(self, logs, step, progress_bar, epoch)

    def _log_values(
        self, logs: dict[str, float], step: int, progress_bar: bool, epoch: int | None = None
    ) -> None:
        """Logs one logging step's host values to loggers, callbacks and the progress bar.

        As Lightning's logger connector does for ``self.log``: each logger gets the row at
        ``step`` with the ``epoch`` it was computed in, ``trainer.logged_metrics`` and
        ``trainer.callback_metrics`` the values. coreshell's own figures are named under
        ``coreshell/``; the progress bar shows the loss and samples/s without adding them to
        ``callback_metrics`` (where a ``ModelCheckpoint(monitor=...)`` would find them).
        """
        logs |= {f"{OWN}bridge/{k}": v for k, v in self.transfer_stats.as_metrics().items()}
        if self.compiled.train is not None:
            logs[f"{OWN}compile/recompiles"] = float(self.compiled.recompiles())
        if self._trainer is not None and self.loggers:
            row: dict[str, float] = logs if epoch is None else {**logs, "epoch": epoch}
            for logger in self.loggers:
                logger.log_metrics(row, step=step)
            self.trainer.logged_metrics.update({k: torch.tensor(v) for k, v in logs.items()})
        # Callbacks read trainer.callback_metrics; LightningModule.log costs ~0.8 ms a value
        # (measured), so the values go there directly.
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in logs.items()})
        if progress_bar:  # (not at the end of training: the last bar has gone)
            self._progress(logs)
        if logs.get(f"{self.adapter.logs.own_train}nonfinite_steps", 0.0):
            self._check_finite()

    def _progress(self, logs: dict[str, float]) -> None:
        """The loss and samples/s in the progress bar only (``trainer.progress_bar_metrics``,
        which the bar reads); a name the user logs keeps its own value there."""
        bar = self.trainer.progress_bar_metrics
        own = self.adapter.logs
        mine = {"loss": f"{own.own_train}loss", "samples/s": f"{OWN}perf/samples_per_s"}
        for name, key in mine.items():
            if key in logs and name not in own.user_names(self):
                bar[name] = logs[key]

    def on_train_end(self) -> None:
        self.train_log.finish()
        self.adapter.logs.last_step_values(self)  # (callback_metrics: the last step's)
        self._check_finite()

    def _check_finite(self) -> None:
        """Under ``nan_policy="stop"``: raises when the step refused an update, naming the
        input field and rows when NaN/Inf came in with the batch (``jaxcore.check_finite``)."""
        if self.state is not None and self.nan_policy == "stop":
            jaxcore.check_finite(self.state, self._float_fields)
