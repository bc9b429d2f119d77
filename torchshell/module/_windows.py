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
  that logging steps close windows (on an accelerator, K=1 unless the host's time between
  steps nearly matches the step: :func:`choose_k`). K=1 under
  ``accumulate_grad_batches``/``accum_steps``, for :meth:`JaxModule.from_lightning` (its
  ``self.log`` runs per step), with several processes (K must agree) and for a traced torch
  forward that reads batch values in Python.
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
import operator
import time
from collections.abc import Callable
from typing import Any

import jax
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._batches import rows
from torchshell.adapters._handover import HandOver, sizeless, stack_form

__all__ = ["Windows", "choose_k", "resolve_steps_per_call"]

_PROBE = 3  # timed steps (after one untimed)
_MAX_K = 16
SMALL_FLOPS = 1e8
"""A step below this many FLOPs always windows (the digits MLP: 3e7; the encoder: ~1e9)."""
TARGET_K = 10
"""Steps per call aimed at for a short step (measured on the digits MLP: 8-16 all gain)."""


def choose_k(
    step_seconds: float,
    shell_seconds: float,
    log_every: int,
    flops: float | None = None,
    overlapped: bool = False,
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

    On an accelerator (``overlapped``) the host's work between two steps runs while the
    device computes (asynchronous dispatch): it is hidden under any step it does not exceed,
    so K=1 unless the shell takes ``>= 0.8x`` the step. There a K-step program is pure cost:
    a second compile (24 s for a Whisper-base-sized encoder on a TPU v5e, which chose K=10
    at a shell of ~0.3x its 75 ms step under the CPU's rule) and K batches held on the host.

    Args:
        step_seconds: one optimizer step, dispatch to result ready.
        shell_seconds: the wall time between two steps (result ready to the next dispatch).
        log_every: the Trainer's ``log_every_n_steps``.
        flops: the step's FLOPs from the compiler, when known.
        overlapped: the step runs on an accelerator, beside the host.

    Returns:
        Steps per jitted call.

    Example:
        >>> choose_k(0.0004, 0.0008, 50), choose_k(0.0004, 0.0008, 1), choose_k(0.03, 0.001, 50)
        (10, 1, 1)
        >>> choose_k(0.009, 0.001, 50, flops=3.2e7)  # the MLP timed on a loaded machine
        10
        >>> choose_k(0.075, 0.022, 50, overlapped=True)  # the encoder on a TPU: hidden
        1
    """
    small = flops is not None and flops < SMALL_FLOPS
    hidden = (0.8 if overlapped else 0.25) * step_seconds
    if (shell_seconds < hidden and not small) or log_every < 2:
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


class Windows:
    """The batches of a ``steps_per_call="auto"`` run: K chosen, then buffered and run K per call.

    Owned by :class:`~torchshell.module.JaxModule` (``module.windows``); it holds no module
    state: the JAX state goes in and comes out of :meth:`timed` and :meth:`run`.

    Args:
        auto: whether K is measured (``steps_per_call="auto"``); otherwise K is 1 here.

    Example:
        >>> w = Windows(auto=True)
        >>> w.measuring(lambda: False), w.k  # nothing to measure: one step per call
        (False, 1)
    """

    choose = staticmethod(choose_k)  # (the tests fix K through this)

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.k: int | None = None if auto else 1  # None while measuring
        self.buffer: list[dict[str, torch.Tensor]] = []
        self.step: jaxcore.Step | None = None  # the K-step program, built at the first window
        self.runs = 0  # windows run K per call
        self.plain_ok = False  # K > 1 chosen and nothing per step on the host but the batch
        self.plain: HandOver | None = None  # the plan every buffered batch matched exactly
        self._transfer: tuple[HandOver, Any, int] | None = None  # (its plan, hand-over, rows)
        self._probe: list[tuple[float, float]] = []
        self._ready: float | None = None

    def buffering(self) -> bool:
        """Whether batches are being buffered (K chosen and > 1)."""
        return self.auto and self.k is not None and self.k > 1

    def measuring(self, windowable: Callable[[], bool]) -> bool:
        """Whether the next step is timed; settles K=1 when the run cannot window (asked
        only while K is open)."""
        if not self.auto or self.k is not None:
            return False
        if not windowable():
            self.k = 1  # nothing to measure: these run one step per call
            return False
        return True

    def timed(self, step_fn: Any, state: Any, jbatch: Any) -> tuple[Any, dict[str, jax.Array]]:
        """Runs one step timed to its result (blocks: only the first steps of a module).

        The first call (it may still load the executable) is not counted.
        """
        t0 = time.perf_counter()
        state, metrics = step_fn(state, jbatch)
        jax.block_until_ready(metrics)
        ready = time.perf_counter()
        # (step time, the shell's time from the last result to this dispatch; a gap over a
        # second spans two fits and is not counted)
        if self._ready is not None and t0 - self._ready < 1.0:
            self._probe.append((ready - t0, t0 - self._ready))
        self._ready = ready
        return state, metrics

    def timings(self) -> tuple[float, float] | None:
        """``(step, shell)`` seconds (the fastest of each) once enough steps were timed."""
        if len(self._probe) < _PROBE:
            return None
        return min(p[0] for p in self._probe), min(p[1] for p in self._probe)

    def take(
        self, batch: dict[str, torch.Tensor], step: int, log_every: int, plan: HandOver | None
    ) -> bool:
        """Keeps the batch (``step``: the ``global_step`` it brings; ``plan``: the hand-over
        plan it matched exactly, if any); whether the window is due (``global_step`` at a
        multiple of K or at a logging step)."""
        if not self.buffer:
            self.plain = plan
        elif plan is not self.plain:
            self.plain = None
        self.buffer.append(batch)
        return step % (self.k or 1) == 0 or step % log_every == 0

    def run(
        self,
        state: Any,
        placement: Any,
        window_step: Callable[[int], jaxcore.Step],
        one_step: Callable[[Any, dict[str, torch.Tensor]], tuple[Any, dict[str, jax.Array]]],
    ) -> tuple[Any, dict[str, jax.Array]]:
        """Empties the buffer: a full window stacked (``[K, B, ...]``, a ``mask`` of real rows)
        and run in one call of ``window_step(K)`` (built once), a short one by ``one_step``,
        and so is a window whose batches do not stack (bucketed lengths, a field in some
        batches only, another dtype).

        Returns:
            The state after the window and the metrics of its last step.
        """
        batches, self.buffer = self.buffer, []
        k = self.k or 1
        if self.plain is not None and len(batches) == k > 1:  # (the plan's: decided once)
            jbatch = self._plain(batches, placement, k)
            if jbatch is not None:
                if self.step is None:
                    self.step = window_step(k)
                self.runs += 1
                return self.step(state, jbatch)  # type: ignore[no-any-return]
        if len(batches) != k or k == 1 or not _one_form(batches):
            metrics: dict[str, jax.Array] = {}  # (a short window, or batches that differ)
            for b in batches:
                state, metrics = one_step(state, b)
            return state, metrics
        sizes = [rows(b) for b in batches]
        n = placement.global_rows(max(sizes))  # (rows the data axis divides)
        padded = [
            b if m == n else bridge.pad_batch(b, n) for b, m in zip(batches, sizes, strict=True)
        ]
        if any("mask" in b for b in padded):
            padded = [bridge.pad_batch(b, n) for b in padded]
        if not all(isinstance(t, torch.Tensor) for b in padded for t in b.values()):
            padded = [sizeless(b) for b in padded]  # (a short batch's list fields, padded)
        stacked = jax.tree.map(lambda *ts: torch.stack(ts), *padded)  # (nested, host-only)
        jbatch = bridge.to_jax(stacked, placement.window, stats=placement.stats)
        if "mask" not in jbatch:
            jbatch["mask"] = placement.window_mask(k, n)
        if self.step is None:
            self.step = window_step(k)
        self.runs += 1
        return self.step(state, jbatch)  # type: ignore[no-any-return]

    def _plain(self, batches: list[Any], placement: Any, k: int) -> dict[str, Any] | None:
        """K batches that matched the plan exactly, stacked and handed over as the plan's
        first window decided (``None``: its rows need padding, or the bridge decides per
        batch)."""
        plan = self.plain
        assert plan is not None
        names = plan.names or plan.order
        if len(names) < 2:  # (one field: itemgetter's result is no tuple; to_jax decides)
            return None
        pick = operator.itemgetter(*names)
        stacked = dict(
            zip(names, map(torch.stack, zip(*map(pick, batches), strict=True)), strict=True)
        )
        if self._transfer is None or self._transfer[0] is not plan:
            n = rows(batches[0])
            transfer = None
            if placement.global_rows(n) == n:
                transfer = bridge.BatchTransfer.plan(stacked, placement.window, placement.stats)
            self._transfer = (plan, transfer, n)
        _, transfer, n = self._transfer
        if transfer is None:
            return None
        jbatch: dict[str, Any] = transfer(stacked)
        jbatch["mask"] = placement.window_mask(k, n)
        return jbatch


def _one_form(batches: list[Any]) -> bool:
    """Whether the window's batches stack: one tree structure (not a field in some batches
    only), each field's per-row shape (not bucketed lengths) and dtype the same."""
    first = stack_form(batches[0])
    return all(stack_form(b) == first for b in batches[1:])
