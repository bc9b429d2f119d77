"""A :class:`~torchshell.module.JaxModule` training step: from Lightning's batch to the jitted
call, as functions of the module (its ``training_step`` is :func:`train_batch`).

The paths a batch takes (docs/architecture.md walks them):

- **windows** (``steps_per_call="auto"`` once K > 1 is chosen, :mod:`._windows`): the batch is
  kept and every K batches run in one call (:func:`buffer_batch`, :func:`run_window`);
- **accumulation** (``Trainer(accumulate_grad_batches=m)``, :mod:`._accumulation`): m batches
  stacked into one optimizer step (:func:`window_batch`);
- **one step per call** otherwise (the first steps too, three of them timed to choose K).

The first batch compiles the train step beside the state's init (:func:`compile_beside_init`).
Which step function, and how its optimizer steps count, is the adapter's (``adapter.steps``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import numpy as np
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._batches import float_fields, rows
from torchshell.adapters._checkpoint import CheckpointLayout
from torchshell.adapters._steps import TrainSteps
from torchshell.module._logging import log_to_loggers, outputs, outputs_wanted, queue_log
from torchshell.summary import param_summary

# The JaxModule these functions serve, by name only: _jax_module imports this file, and an
# import back (even for type checking) would close a cycle.
JaxModule = Any

__all__ = ["buffer_batch", "run_window", "step_forward", "train_batch"]

_QUIET = contextlib.nullcontext()  # (an adapter's context that does nothing: not asked)


def train_batch(module: JaxModule, batch: Any, batch_idx: int = 0) -> Any:
    """``training_step``: runs the compiled step on ``batch``, or buffers it for a window.

    A batch that matches the run's hand-over plan exactly, once K > 1 is chosen, is only
    kept (:func:`buffer_batch`): nothing about it is worked out again. Returns
    ``{"loss": loss}`` (waiting for the step) only when a user callback reads
    ``on_train_batch_end``'s outputs, as plain Lightning gives them; else ``None``, so the
    loop never waits for the device.
    """
    adapter, windows = module.adapter, module.windows
    plan = adapter.plan
    if (
        windows.plain_ok
        and plan is not None
        and module.flags.accumulate == 1
        and (named := plan.same(batch)) is not None
    ):
        return buffer_batch(module, named, plan, time.perf_counter())
    group, hooks = adapter.steps, adapter.hooks  # (adapter calls that are no-ops: skipped)
    with group.counted(module) if group.counts else _QUIET:  # (the port's manual optimization)
        if adapter.checkpoint.host_versions:  # (the port: host code's in-place changes)
            adapter.checkpoint.before_step(module)
        t0 = time.perf_counter()
        raw, batch = batch, adapter.prepare(batch)
        if module._float_fields is None:  # (NaN/Inf in them: refused inside the step)
            module._float_fields = float_fields(batch)
        m = module.flags.accumulate
        if m == 1 and (windows.k or 1) > 1:  # (K > 1 chosen: buffering)
            plan = adapter.plan
            exact = plan is not None and plan.same(raw) is not None
            return buffer_batch(module, batch, plan if exact else None, t0)
        if m > 1:
            if module.steps_per_call > 1 or module.accum_steps > 1:
                raise ConfigError(
                    f"accumulate_grad_batches={m} with steps_per_call={module.steps_per_call} "
                    f"and accum_steps={module.accum_steps}: choose one way to group steps. Fix: "
                    "keep accumulate_grad_batches and set the other two to 1."
                )
            ahead = hooks.outputs_ahead(module, batch, len(module.accumulation.batches), raw)
            window = window_batch(module, batch)
            if window is None:
                module.train_log.compute += time.perf_counter() - t0
                return ahead
            jbatch, one, rows_, micro = window
            steps = 1
        else:
            jbatch, one, rows_ = adapter.one_step_view(batch, module.steps_per_call)
            micro, steps = module.accum_steps, module.steps_per_call
            ahead = hooks.outputs_ahead(module, batch, 0, raw) if hooks.ahead else None
        if module._state is None and module.compiled.train is None and m == 1:
            compile_beside_init(module, one, micro, jbatch)
        if module._state is None or windows.buffer:  # (else the state is current: no call)
            module.init_state(one)
        trainer = module._trainer
        before = trainer.global_step  # type: ignore[union-attr]
        metrics = _run_step(module, group.step_for(module, micro, jbatch), jbatch, one)
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress  # type: ignore[union-attr]
        for _ in range(steps):  # (Lightning's global_step advanced by the steps run)
            progress.increment_ready()
            progress.increment_completed()
        rows_ *= micro if m > 1 else 1
        adapter.logs.after_step(module, metrics, rows_)
        module.train_log.compute += time.perf_counter() - t0
        if group.logging_step(module, before):
            queue_log(module, metrics, rows_)
        if ahead is not None or not outputs_wanted(module):
            return ahead
        return outputs(module, metrics)


def _run_step(module: JaxModule, step_fn: jaxcore.Step, jbatch: Any, one: Any) -> Any:
    """One call of the step (timed while K is measured); the compile statistics logged once."""
    adapter, windows = module.adapter, module.windows
    with adapter.checked(one) if adapter.checks_fields else _QUIET:  # (measuring: K open)
        if windows.auto and windows.k is None and windows.measuring(lambda: windowable(module)):
            module._state, metrics = windows.timed(step_fn, module._state, jbatch)
            if (times := windows.timings()) is not None:
                _choose_k(module, times, jbatch, one)
        else:
            module._state, metrics = step_fn(module._state, jbatch)
    compiled = module.compiled
    if compiled.stats_due and compiled.stats is not None:
        compiled.stats_due = False
        log_to_loggers(module, {f"compile/{k}": v for k, v in compiled.stats.as_dict().items()})
    module._last_metrics = metrics
    return metrics


# -- K batches per call (steps_per_call="auto", see torchshell.module._windows) ---------------
def buffer_batch(module: JaxModule, batch: Any, plan: Any, t0: float) -> None:
    """Keeps the batch (``plan``: the hand-over plan it matched exactly, or ``None``); runs
    the window when one is due, and queues a logging step's metrics."""
    trainer = module._trainer
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress  # type: ignore[union-attr]
    progress.increment_ready()  # (Lightning's global_step: this batch's optimizer step)
    progress.increment_completed()
    every = max(int(trainer.log_every_n_steps), 1)  # type: ignore[union-attr]
    step = trainer.global_step  # type: ignore[union-attr]
    if module.windows.take(batch, step, every, plan):
        metrics = run_window(module)
        if step % every == 0:
            queue_log(module, metrics, module.adapter.global_rows(batch))
    module.train_log.compute += time.perf_counter() - t0


def run_window(module: JaxModule) -> dict[str, jax.Array]:
    """Runs the buffered batches: K in one call, or one per call for a short window."""
    module._state, metrics = module.windows.run(
        module._state,
        module.placement,
        lambda k: _window_step(module, k),
        lambda state, batch: _one_step(module, state, batch),
    )
    module._last_metrics = metrics
    return metrics


def _window_step(module: JaxModule, k: int) -> jaxcore.Step:
    """The K-step program of ``steps_per_call="auto"`` windows: the rows' gradients, the NaN
    guard, K steps per call (jaxcore's transforms chained)."""
    assert module._state is not None
    tx = module.optimizer()
    dtype = module._compute_dtype
    grad_fn = jaxcore.row_grads(module.model_fns, module.loss_fn, compute_dtype=dtype)
    step = jaxcore.train_step(grad_fn, tx, nan_policy=module.nan_policy)
    return jaxcore.jit_step(
        jaxcore.k_steps(step, k) if k > 1 else step,
        state_sharding=jaxcore.state_shardings(module._state),
    )


def _one_step(module: JaxModule, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
    """One step of a window cut short (K=1 math, one call per batch)."""
    jbatch, one, _ = module.adapter.one_step_view(batch, 1)
    assert module.compiled.train is not None
    with module.adapter.checked(one):
        return module.compiled.train(state, jbatch)  # type: ignore[no-any-return]


def windowable(module: JaxModule) -> bool:
    """Whether this run can buffer batches (else K=1, nothing measured)."""
    return (
        module.adapter.supports_windows
        and module.flags.accumulate == 1
        and module.accum_steps == 1
        and jax.process_count() == 1
        and not outputs_wanted(module)  # a callback reads each step's loss
    )


def _choose_k(module: JaxModule, times: tuple[float, float], jbatch: Any, batch: Any) -> None:
    every = max(int(module.trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]
    flops = getattr(module.compiled.stats, "flops_per_step", None)
    can = not module.adapter.reads_values(jbatch) and "mask" not in batch
    overlapped = module.adapter.placement.mesh.devices.flat[0].platform != "cpu"
    module.windows.k = k = module.windows.choose(*times, every, flops, overlapped) if can else 1
    adapter = module.adapter  # (batches matching the plan skip the per-step host protocol)
    quiet = type(adapter.steps).counted is TrainSteps.counted and (
        type(adapter.checkpoint).before_step is CheckpointLayout.before_step
    )
    module.windows.plain_ok = k > 1 and quiet
    log_to_loggers(module, {"compile/steps_per_call": float(k)})
    if k > 1:
        _compile_window(module, k, batch)


def _compile_window(module: JaxModule, k: int, batch: Any) -> None:
    """The K-step program compiled as soon as K is chosen, on a window of K copies of this
    batch (handed over as every full window is, its transfer not counted), so that the first
    full window does not stop to trace and compile it. Only when the fit reaches a full
    window, and for a batch of tensors whose rows need no padding (else the first window
    compiles it)."""
    trainer, placement = module.trainer, module.placement
    step = trainer.global_step
    n = rows(batch)
    if (
        trainer.estimated_stepping_batches < (step // k + 2) * k
        or placement.global_rows(n) != n
        or type(batch) is not dict
        or "mask" in batch
        or not all(isinstance(t, torch.Tensor) for t in batch.values())  # (nested, host-only)
    ):
        return
    stacked = {name: torch.stack([t] * k) for name, t in batch.items()}
    transfer = bridge.BatchTransfer.plan(stacked, placement.window, bridge.new_stats())
    if transfer is None:
        return
    jbatch = transfer(stacked)
    jbatch["mask"] = placement.window_mask(k, n)
    module.windows.step = window = _window_step(module, k)
    window.compile(module._state, jbatch)


# -- accumulate_grad_batches windows (see torchshell.module._accumulation) --------------------
def window_batch(module: JaxModule, batch: Any) -> tuple[Any, Any, int, int] | None:
    """Collects ``accumulate_grad_batches`` batches; the stacked window when complete."""
    m = module.flags.accumulate
    last = module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    window = module.accumulation.take(batch, m, last, module.adapter.global_rows)
    if window is None:
        return None
    rows_ = module.accumulation.micro_rows[0]
    return module.adapter.stack(window, m), window[0], rows_, len(window)


# -- the first batch ------------------------------------------------------------------------
def compile_beside_init(module: JaxModule, one: Any, micro: int, jbatch: Any) -> None:
    """The first batch: the state's init program compiles in the background while the
    train step is traced and compiled on the state's shapes (``jaxcore.PendingState``);
    with a warm compile cache the two executables load side by side."""
    module.compiled.pending = start_state(module, one)
    module.adapter.steps.compile_train_step(module, micro, module.compiled.pending.abstract, jbatch)


def start_state(module: JaxModule, batch: Any) -> jaxcore.PendingState:
    """The state's init, compiling (``jaxcore.start_train_state``)."""
    return jaxcore.start_train_state(
        module.model_fns,
        module.optimizer(),
        module.adapter.sample(batch),
        seed=module.seed,
        mesh=module.mesh,
        param_shardings=module.shard_fn,
    )


def step_forward(module: JaxModule, batch: Any, i: int) -> tuple[Any, jax.Array]:
    """The next train step's forward pass on ``batch`` (its micro-batch ``i``) alone."""
    if module.compiled.forward is None:
        module.compiled.forward = jaxcore.make_train_forward(
            module.model_fns,
            module.loss_fn,
            micro=module.flags.accumulate > 1,
            compute_dtype=module._compute_dtype,
            weigh_rows=module.adapter.weigh_rows,
        )
    state = module.init_state(batch)
    forward = module.compiled.forward
    return forward(state, module.adapter.sample(batch), np.int32(i))  # type: ignore[no-any-return]


def init_state(module: JaxModule, batch: Any) -> jaxcore.TrainState:
    """The train state, built from a sample batch (shapes only) on first use (restored from
    what a checkpoint left waiting, and the adapter's own layout)."""
    state = module.state  # (read once: a property, running any buffered batches first)
    if state is None:
        pending, module.compiled.pending = (
            module.compiled.pending or start_state(module, batch),
            None,
        )
        state = pending.result()
        module.state = state = module.held.apply(state)
        module.adapter.planned(batch)
        module.summary = param_summary(state.params)
        if module.print_summary and (module._trainer is None or module.trainer.is_global_zero):
            print(f"JAX params on mesh {dict(module.mesh.shape)}:\n{module.summary}")
        module.state = state = module.adapter.checkpoint.restored(module, state)  # (user's layout)
    return state  # type: ignore[no-any-return]
