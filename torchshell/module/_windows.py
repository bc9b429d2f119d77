"""``steps_per_call="auto"``: the user's batches buffered and run K per jitted call.

The default of :class:`~torchshell.module.JaxModule`. Lightning hands over one DataLoader
batch per ``training_step``; for a model whose step is short (the digits MLP: ~0.4 ms of
math against ~0.3 ms of dispatch and hand-over), the module keeps the batch (a reference,
no copy) and every K batches stacks them (``[K, B, ...]``, one copy of K small batches) and
runs K optimizer steps in one jitted call (``lax.scan``). The semantics:

- **K** is chosen once per module, from the measured step time: the first training steps run
  one per call, three of them timed until their result is ready (the only blocking steps; the
  hot path never waits for the device). A step of ``>= 2 ms`` keeps K=1 (the compute
  dominates; XLA CPU also runs a scanned body slower than a single step); otherwise K is the
  largest divisor of ``log_every_n_steps`` at most ``ceil(4 ms / step)`` (at most 16), so
  that logging steps close windows. K=1 under ``accumulate_grad_batches``/``accum_steps``,
  for :meth:`JaxModule.from_lightning` (its ``self.log`` runs per step), with several
  processes (K must agree) and for a traced torch forward that reads batch values in Python.
- **global_step** counts the batches taken, as with K=1: ``max_steps``, ``log_every_n_steps``,
  ``every_n_train_steps`` checkpoints and ``val_check_interval`` mean what they mean in
  Lightning. Windows close when ``global_step`` is a multiple of K.
- **The JAX state catches up whenever it is read**: ``module.state`` runs the buffered batches
  first (validation, a checkpoint, export, the end of fit, a logging step, a callback reading
  it). A window cut short this way runs one step per call, so the weights are those of K=1
  steps, in the same order (equal within float tolerance: the same math, scanned).
- **Callbacks and logging**: ``on_train_batch_end`` runs per batch; the metrics logged at a
  logging step are that step's own (the last of its window). ``perf/*`` figures are per
  optimizer step.
- **Resume**: the buffer is empty in a checkpoint (a save reads the state); a resumed run
  re-measures K and starts windows at the next multiple of K.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.module._batches import rows

__all__ = ["WindowPart", "choose_k"]

_PROBE = 3  # timed steps (after one untimed)
_MAX_K = 16
SMALL_FLOPS = 1e8
"""A step below this many FLOPs always windows (the digits MLP: 3e7; the encoder: ~1e9)."""
TARGET_K = 10
"""Steps per call aimed at for a short step (measured on the digits MLP: 8-16 all gain)."""


def choose_k(
    step_seconds: float, shell_seconds: float, log_every: int, flops: float | None = None
) -> int:
    """K for a measured step: 1 when the step dominates, else about 10 steps per call.

    Both times are measured side by side in one run (a loaded machine slows both), so the
    choice rests on their ratio, which has a wide margin: the digits MLP's step takes about
    as long as the shell's own time between two steps (Lightning's loop, the loader, the
    hand-over), the spoken-digits encoder's about 30x longer. K=1 when the step takes
    ``>= 4x`` the shell's time; otherwise the divisor of ``log_every`` nearest to
    :data:`TARGET_K` (2 to 16), so that logging steps close windows. A larger K costs only
    K batches held on the host; the scanned step compiles once whatever K is. A step of
    under :data:`SMALL_FLOPS` (XLA's count) is short whatever the clocks say: on a loaded
    machine the timed result waits for a busy core, which inflates the step, not the shell.

    Args:
        step_seconds: one optimizer step, dispatch to result ready.
        shell_seconds: the wall time between two steps (result ready to the next dispatch).
        log_every: the Trainer's ``log_every_n_steps``.
        flops: the step's FLOPs from the compiler, when known.

    Returns:
        Steps per jitted call.

    Example:
        >>> choose_k(0.0004, 0.0008, 50), choose_k(0.0004, 0.0008, 1), choose_k(0.03, 0.001, 50)
        (10, 1, 1)
        >>> choose_k(0.009, 0.001, 50, flops=3.2e7)  # the MLP timed on a loaded machine
        10
    """
    small = flops is not None and flops < SMALL_FLOPS
    if (shell_seconds < 0.25 * step_seconds and not small) or log_every < 2:
        return 1
    divisors = [d for d in range(2, _MAX_K + 1) if log_every % d == 0]
    if not divisors:
        return 1
    return min(divisors, key=lambda d: (abs(math.log(d / TARGET_K)), -d))


def resolve_steps_per_call(value: int | str) -> tuple[int, bool]:
    """``(steps_per_call, auto)`` from the ``steps_per_call`` argument.

    Example:
        >>> resolve_steps_per_call("auto"), resolve_steps_per_call(4)
        ((1, True), (4, False))
    """
    if value == "auto":
        return 1, True
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"steps_per_call must be 'auto' or an int >= 1, got {value!r}. Fix: leave the "
            "default 'auto' (batches buffered and run K per call), or 1 for one step per call."
        )
    return value, False


class WindowPart:
    """Buffers batches and runs them K per call (see the module docstring).

    Mixed into :class:`~torchshell.module.JaxModule`; uses its step factory and hand-over.
    """

    supports_windows = True  # from_lightning: False (the user's self.log runs per step)
    _choose = staticmethod(choose_k)  # (the tests fix K through this)
    _auto: bool
    _k: int | None  # None while measuring
    _buffer: list[dict[str, torch.Tensor]]
    _probe: list[tuple[float, float]]
    _state_value: Any
    _window_step: Any
    _windows: int

    # -- the state catches up when read -------------------------------------------------------
    @property
    def state(self) -> Any:
        if self.__dict__.get("_buffer"):
            self._flush_window()
        return self.__dict__.get("_state_value")

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_state_value"] = value

    def _init_windows(self, auto: bool) -> None:
        self._auto = auto
        self._k = None if auto else 1
        self._buffer = []
        self._probe = []
        self._ready: float | None = None
        self._window_step = None
        self._windows = 0
        self._last_metrics: dict[str, jax.Array] = {}

    @property
    def window_k(self) -> int | None:
        """K chosen by ``steps_per_call="auto"`` (``None`` while measuring; 1 when off)."""
        return self._k

    def _buffering(self) -> bool:
        return self._auto and self._k is not None and self._k > 1

    def _can_window(self, jbatch: Any, batch: Any) -> bool:
        t: Any = self
        return not t.adapter.reads_values(jbatch) and "mask" not in batch

    def _measuring(self) -> bool:
        if not self._auto or self._k is not None:
            return False
        t: Any = self
        if (
            not self.supports_windows
            or t.flags.accumulate != 1
            or t.accum_steps != 1
            or jax.process_count() != 1
            or t._outputs_wanted()  # a callback reads each step's loss
        ):
            self._k = 1  # nothing to measure: these run one step per call
            return False
        return True

    def _measure(self, step_fn: Any, jbatch: Any, batch: Any) -> dict[str, jax.Array]:
        """Runs one step, timed to its result (blocks: only the first steps of a module).

        The first call (it may still load the executable) is not counted.
        """
        t: Any = self
        t0 = time.perf_counter()
        t.__dict__["_state_value"], metrics = step_fn(self._state_value, jbatch)
        jax.block_until_ready(metrics)
        ready = time.perf_counter()
        # (step time, the shell's time from the last result to this dispatch; a gap over a
        # second spans two fits and is not counted)
        if self._ready is not None and t0 - self._ready < 1.0:
            self._probe.append((ready - t0, t0 - self._ready))
        self._ready = ready
        if len(self._probe) < _PROBE:
            return metrics  # type: ignore[no-any-return]
        every = max(int(t.trainer.log_every_n_steps), 1)
        step_s = min(p[0] for p in self._probe)
        shell_s = min(p[1] for p in self._probe)
        flops = getattr(t.compile_stats, "flops_per_step", None)
        k = self._choose(step_s, shell_s, every, flops) if self._can_window(jbatch, batch) else 1
        self._k = k
        t._log_to_loggers({"compile/steps_per_call": float(k)})
        return metrics  # type: ignore[no-any-return]

    # -- buffered steps -----------------------------------------------------------------------
    def _buffer_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, jax.Array] | None:
        """Keeps the batch; runs the window when ``global_step`` reaches a multiple of K.

        Returns the metrics of the window's last step when one ran (else ``None``).
        """
        t: Any = self
        self._buffer.append(batch)
        progress = t.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        step = t.trainer.global_step
        every = max(int(t.trainer.log_every_n_steps), 1)
        if step % (self._k or 1) == 0 or step % every == 0:
            return self._flush_window()
        return None

    def _flush_window(self) -> dict[str, jax.Array]:
        """Runs the buffered batches: K in one call, or one per call for a short window."""
        t: Any = self
        batches, self._buffer = self._buffer, []
        state = self._state_value
        k = self._k or 1
        n = max(rows(b) for b in batches)
        if len(batches) == k and k > 1:
            padded = [b if rows(b) == n else bridge.pad_batch(b, n) for b in batches]
            if any("mask" in b for b in padded):
                padded = [bridge.pad_batch(b, n) for b in padded]
            stacked = {name: torch.stack([b[name] for b in padded]) for name in padded[0]}
            p = t.placement
            jbatch = bridge.to_jax(stacked, p.window, stats=p.stats)
            if "mask" not in jbatch:
                jbatch["mask"] = p.window_mask(k, n)
            if self._window_step is None:
                self._window_step = jaxcore.make_train_step(
                    t.model_fns,
                    t.loss_fn,
                    t.optimizer(),
                    state_sharding=jaxcore.state_shardings(state),
                    steps_per_call=k,
                    compute_dtype=t._compute_dtype,
                    nan_policy=t.nan_policy,
                )
            state, metrics = self._window_step(state, jbatch)
            self._windows += 1
        else:
            step_fn = t._train_step
            metrics = {}
            for b in batches:
                jbatch, one, _ = t.adapter.one_step_view(b, 1)
                with t.adapter.checked(one):
                    state, metrics = step_fn(state, jbatch)
        self.__dict__["_state_value"] = state
        self._last_metrics = metrics
        return metrics

    @property
    def window_compiles(self) -> int:
        """Compilations of the K-step window (0 or 1; reported under ``compile/``)."""
        return 0 if self._window_step is None else self._window_step.compiles
