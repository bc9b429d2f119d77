"""Training metrics of a :class:`JaxModule`: on device until the logging step, then logged late.

Metrics stay on device; at each logging step (``log_every_n_steps`` optimizer steps) their
copy to the host starts, and the previous logging step's values (long computed) are logged.
So fetching never waits for the device. The last ones are logged at the end of training.

Each logging step's values are logged at the step and epoch they were computed in (Lightning's
logger step for them, see :meth:`TrainSteps.log_step`), however late they are fetched.
coreshell's own figures (throughput here, compile and transfer statistics in
:mod:`torchshell.module._logging`) are named under :data:`OWN` (``system/coreshell.``), so they
never shadow a name the user logs.

What is logged and under which names is the adapter's (``Adapter.logs``): :class:`TrainLogs`
for the Flax and torch paths, ``LightningLogs`` (:mod:`torchshell.port._user`) for a ported
``LightningModule``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

__all__ = ["OWN", "TrainLog", "TrainLogs", "find_lrs"]

# the prefix of coreshell's own telemetry (throughput, compile, bridge): MLflow's UI puts
# `system/` keys in the run page's System metrics tab, and a key with no further `/` in its
# "System metrics" section, after the model's own (docs/tracking.md)
OWN = "system/coreshell."


def find_lrs(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Learning rates injected as hyperparameters anywhere in an optax state (chains too).

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> tx = jaxcore.make_optimizer(lr=0.5)
        >>> {k: float(v) for k, v in find_lrs(tx.init({"w": jnp.zeros(2)})).items()}
        {'train/lr': 0.5}
    """

    def has_hyper(x: Any) -> bool:
        return hasattr(x, "hyperparams")

    found = [
        s.hyperparams["learning_rate"]
        for s in jax.tree.leaves(opt_state, is_leaf=has_hyper)
        if has_hyper(s) and "learning_rate" in s.hyperparams
    ]
    return {"train/lr": found[0]} if found else {}


class TrainLog:
    """The timing and pending metrics of one run's training loop (host side).

    Args:
        emit: ``(logs, step, progress_bar, epoch)`` called with one logging step's host
            values, the step and epoch they were queued at.
    """

    def __init__(self, emit: Callable[[dict[str, float], int, bool, int | None], None]) -> None:
        self.emit = emit
        self.wait = 0.0  # seconds spent waiting for data since the last log
        self.compute = 0.0  # seconds in the hand-over + step dispatch since the last log
        self.batch_end: float | None = None  # (JaxModule's batch hooks: the wait between)
        self._last: tuple[float, int] | None = None
        self._pending: tuple[dict[str, jax.Array], dict[str, float], int, int | None] | None = None

    def queue(
        self, values: dict[str, jax.Array], rows: int, step: int, epoch: int | None = None
    ) -> None:
        """Starts copying this logging step's ``values`` to the host; logs the previous ones.

        ``values`` must be fresh arrays (copies), never buffers of a donated state; ``step``
        and ``epoch`` are where they are logged (``step`` also times the throughput).
        """
        for value in values.values():
            value.copy_to_host_async()
        if self._pending is not None:
            self._flush(self._pending, progress_bar=True)
        self._pending = (values, self._perf(rows, step), step, epoch)

    def finish(self) -> None:
        """Logs the last pending values (at the end of training)."""
        if self._pending is not None:
            self._flush(self._pending, progress_bar=False)
            self._pending = None

    def _perf(self, rows: int, step: int) -> dict[str, float]:
        """Host-side throughput since the last logging step, measured now (not when logged)."""
        now = time.perf_counter()
        perf = {}
        if self._last is not None and step > self._last[1]:
            elapsed = now - self._last[0]
            rate = (step - self._last[1]) / elapsed
            perf = {
                f"{OWN}perf.steps_per_s": rate,
                f"{OWN}perf.samples_per_s": rate * rows,
                f"{OWN}perf.data_wait_fraction": min(self.wait / elapsed, 1.0),
                f"{OWN}perf.step_fraction": min(self.compute / elapsed, 1.0),
            }
        self._last, self.wait, self.compute = (now, step), 0.0, 0.0
        return perf

    def _flush(self, pending: Any, progress_bar: bool) -> None:
        values, perf, step, epoch = pending
        host = jax.device_get(values)
        logs = {k: float(np.asarray(v).reshape(-1)[-1]) for k, v in host.items()}
        self.emit(logs | perf, step, progress_bar, epoch)


def fresh(tree: dict[str, Any]) -> dict[str, jax.Array]:
    """Copies of metric arrays (a donated state's buffers must not be kept)."""
    return {k: jnp.array(v) for k, v in tree.items()}


class TrainLogs:
    """What training logs and under which names: the Flax and torch adapters' ``logs``.

    The model's loss function names its metrics, logged as ``train/<name>``, with the step's
    learning rate and refused-step count under :attr:`own_train`. Each method receives the
    :class:`~torchshell.module.JaxModule` whose hook calls it; the port's ``LightningLogs``
    gives the user's ``self.log`` names and options through the same calls.

    Example:
        >>> logs = TrainLogs()
        >>> sorted(logs.train_values(None, {"loss": 1.0, "acc": 0.5}))
        ['train/acc', 'train/loss']
    """

    own_train = "train/"  # the prefix of the step's own loss, learning rate, refused steps

    def train_values(self, module: Any, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A logging step's on-device values under their logged names."""
        return {f"train/{k}": v for k, v in metrics.items()}

    def user_names(self, module: Any) -> set[str]:
        """Names the user logs (the progress bar keeps their values): none here."""
        return set()

    def align_logger_step(self, module: Any) -> None:
        """Before each training batch: Lightning's logger step is left as it is."""

    def log_step(self, module: Any) -> int:
        """The logger step of the values of the step that just ran: the optimizer steps done
        (``global_step``)."""
        return int(module.trainer.global_step)

    def emit(
        self,
        module: Any,
        logs: dict[str, float],
        step: int,
        progress_bar: bool,
        epoch: int | None = None,
    ) -> None:
        """One logging step's host values, all logged (``JaxModule._log_values``)."""
        module._log_values(logs, step, progress_bar, epoch)

    def after_step(self, module: Any, metrics: dict[str, jax.Array], rows: int) -> None:
        """After every compiled step (``rows``: its rows): nothing to add up here."""

    def train_epoch_end(self, module: Any) -> None:
        """At ``on_train_epoch_end``: no epoch values here (the loss function's are per step)."""

    def last_step_values(self, module: Any) -> None:
        """At ``on_train_end``: ``callback_metrics`` end with the last step's values, as in
        plain Lightning.

        Also when it was not a logging step (a run shorter than ``log_every_n_steps``): one
        fetch per fit. Reading ``state`` first runs any buffered batches.
        """
        if module.state is None or not module._last_metrics:
            return
        last = jax.device_get(self.train_values(module, module._last_metrics))
        module.trainer.callback_metrics.update(
            {k: torch.tensor(float(np.ravel(v)[-1])) for k, v in last.items()}
        )
