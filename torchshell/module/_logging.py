"""What a :class:`~torchshell.module.JaxModule` training step gives back to Lightning, as
functions of the module: the values logged at the logging cadence (to the loggers,
``callback_metrics`` and the progress bar), the outputs a user callback reads, and the NaN/Inf
check read at those syncs.

Which values, under which names, is the adapter's (``adapter.logs``:
:class:`~torchshell.adapters.TrainLogs`); the module's :class:`~torchshell.adapters.TrainLog`
holds them on device until the next logging step fetches them.
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

# The JaxModule these functions serve, by name only: _jax_module imports this file, and an
# import back (even for type checking) would close a cycle.
JaxModule = Any

__all__ = ["check_finite", "log_to_loggers", "log_values", "outputs_wanted", "queue_log"]


def outputs_wanted(module: JaxModule) -> bool:
    """A user callback overrides ``on_train_batch_end``: it may read ``outputs["loss"]``.

    (Lightning's and coreshell's own callbacks never read the outputs.) The model's own
    hooks may too (``adapter.hooks.wants_outputs``: the port's ``on_train_batch_end``).
    """
    trainer = module._trainer
    if trainer is None:
        return bool(module.adapter.hooks.wants_outputs(module))
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    key = (id(trainer), len(callbacks))
    if module._wants_outputs[0] != key:  # once per fit, not step (the model's hooks too)
        wanted = module.adapter.hooks.wants_outputs(module) or any(
            not type(cb).__module__.startswith(("lightning.", "torchshell."))
            and is_overridden("on_train_batch_end", cb, parent=L.Callback)
            for cb in callbacks
        )
        module._wants_outputs = (key, wanted)
    return module._wants_outputs[1]


def outputs(
    module: JaxModule, metrics: Mapping[str, jax.Array] | None
) -> dict[str, torch.Tensor] | None:
    """``{"loss": ...}`` for a callback reading ``on_train_batch_end``'s outputs, else None."""
    if metrics is None or not outputs_wanted(module):
        return None
    return {"loss": torch.tensor(float(np.ravel(jax.device_get(metrics["loss"]))[-1]))}


def log_to_loggers(module: JaxModule, metrics: dict[str, float]) -> None:
    """coreshell's own figures (compile statistics) to the loggers, named under
    ``system/coreshell.``, at the step of the values they came with."""
    if module._trainer is not None and module.loggers:
        own = {k if k.startswith(OWN) else OWN + k.replace("/", "."): v for k, v in metrics.items()}
        for logger in module.loggers:
            logger.log_metrics(own, step=module.adapter.steps.log_step(module))
        module.trainer.logged_metrics.update({k: torch.tensor(v) for k, v in own.items()})


def queue_log(module: JaxModule, metrics: dict[str, jax.Array], rows: int) -> None:
    """A logging step's values, kept on device until the next logging step fetches them."""
    state = module.state
    assert state is not None
    logs = module.adapter.logs
    extra: dict[str, Any] = {f"{logs.own_train}lr": lr for lr in find_lrs(state.opt_state).values()}
    if module.nan_policy != "none":
        extra[f"{logs.own_train}nonfinite_steps"] = state.nonfinite
    values = {**logs.train_values(module, metrics), **fresh(extra)}  # copies: donated state
    step = module.adapter.steps.log_step(module)
    module.train_log.queue(values, rows, step, module.trainer.current_epoch)


def log_values(
    module: JaxModule,
    logs: dict[str, float],
    step: int,
    progress_bar: bool,
    epoch: int | None = None,
) -> None:
    """Logs one logging step's host values to loggers, callbacks and the progress bar.

    As Lightning's logger connector does for ``self.log``: each logger gets the row at
    ``step`` with the ``epoch`` it was computed in, ``trainer.logged_metrics`` and
    ``trainer.callback_metrics`` the values. coreshell's own figures are named under
    ``system/coreshell.``; the progress bar shows the loss and samples/s without adding them to
    ``callback_metrics`` (where a ``ModelCheckpoint(monitor=...)`` would find them).
    """
    logs |= {f"{OWN}bridge.{k}": v for k, v in module.transfer_stats.as_metrics().items()}
    if module.compiled.train is not None:
        logs[f"{OWN}compile.recompiles"] = float(module.compiled.recompiles())
    trainer = module.trainer
    if module._trainer is not None and module.loggers:
        row: dict[str, float] = logs if epoch is None else {**logs, "epoch": epoch}
        for logger in module.loggers:
            logger.log_metrics(row, step=step)
        trainer.logged_metrics.update({k: torch.tensor(v) for k, v in logs.items()})
    # Callbacks read trainer.callback_metrics; LightningModule.log costs ~0.8 ms a value
    # (measured), so the values go there directly.
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in logs.items()})
    if progress_bar:  # (not at the end of training: the last bar has gone)
        _progress(module, logs)
    if logs.get(f"{module.adapter.logs.own_train}nonfinite_steps", 0.0):
        check_finite(module)


def _progress(module: JaxModule, logs: dict[str, float]) -> None:
    """The loss and samples/s in the progress bar only (``trainer.progress_bar_metrics``,
    which the bar reads); a name the user logs keeps its own value there."""
    bar = module.trainer.progress_bar_metrics
    own = module.adapter.logs
    mine = {"loss": f"{own.own_train}loss", "samples/s": f"{OWN}perf.samples_per_s"}
    for name, key in mine.items():
        if key in logs and name not in own.user_names(module):
            bar[name] = logs[key]


def check_finite(module: JaxModule) -> None:
    """Under ``nan_policy="stop"``: raises when the step refused an update, naming the
    input field and rows when NaN/Inf came in with the batch (``jaxcore.check_finite``)."""
    if module.state is not None and module.nan_policy == "stop":
        jaxcore.check_finite(module.state, module._float_fields)
