"""Training metrics of a :class:`JaxModule`: on device until the logging step, then logged late.

Metrics stay on device; at each logging step (``log_every_n_steps`` optimizer steps) their
copy to the host starts, and the previous logging step's values (long computed) are logged.
So fetching never waits for the device. The last ones are logged at the end of training.

Each logging step's values are logged at the step and epoch they were computed in (Lightning's
logger step for them, see :meth:`TrainLogPart._log_step`), however late they are fetched.
coreshell's own figures (throughput here, compile and transfer statistics in
:class:`~torchshell.module._train_parts.TrainLogPart`) are named under :data:`OWN` (``coreshell/``),
so they never shadow a name the user logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["OWN", "TrainLog", "find_lrs"]

OWN = "coreshell/"  # the prefix of coreshell's own telemetry (throughput, compile, bridge)


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
        self.batch_end: float | None = None
        self._last: tuple[float, int] | None = None
        self._pending: tuple[dict[str, jax.Array], dict[str, float], int, int | None] | None = None

    def batch_started(self) -> None:
        if self.batch_end is not None:
            self.wait += time.perf_counter() - self.batch_end

    def batch_ended(self) -> None:
        self.batch_end = time.perf_counter()

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
                f"{OWN}perf/steps_per_s": rate,
                f"{OWN}perf/samples_per_s": rate * rows,
                f"{OWN}perf/data_wait_fraction": min(self.wait / elapsed, 1.0),
                f"{OWN}perf/step_fraction": min(self.compute / elapsed, 1.0),
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
