"""The Flax and torch adapters' ``steps`` group: the train step of the model and loss."""

from __future__ import annotations

import contextlib
from typing import Any

import jaxcore
from torchshell.adapters._batches import MicroBatches

__all__ = ["TrainSteps"]


class TrainSteps:
    """The step function the module's adapter supplies (``adapter.steps``), and the counts of
    the steps it takes: the Flax and torch adapters' (the port's adds manual optimization:
    :class:`~torchshell.port._manual_parts.LightningSteps`). Each method is given the
    :class:`~torchshell.module.JaxModule` whose hooks call it."""

    def build_train_step(
        self, module: Any, micro: int, state: Any, grad_scale: float = 1.0, ragged: bool = False
    ) -> jaxcore.Step:
        """The train step for ``state`` (the state, or its abstract twin while it inits),
        chained from jaxcore's transforms: the rows' gradients, then the micro-batches (a
        Lightning accumulation window of ``micro`` batches, stacked, or ``ragged``: batches
        of other shapes, unrolled; else the module's ``accum_steps``), the gradient hooks (a
        short window's ``grad_scale``, the adapter's own), the NaN guard, K steps per call."""
        tx = module.optimizer()
        sharding = jaxcore.state_shardings(state)
        window = module.flags.accumulate > 1
        weigh = module.adapter.weigh_rows
        per_micro = window and not weigh  # (Lightning's self.log of each accumulated batch)
        grad_fn = jaxcore.row_grads(
            module.model_fns, module.loss_fn, compute_dtype=module._compute_dtype, weigh_rows=weigh
        )
        if ragged:
            grad_fn = jaxcore.unrolled(grad_fn, per_micro=per_micro)
        elif window:
            grad_fn = jaxcore.accumulate(grad_fn, micro, stacked=True, per_micro=per_micro)
        else:
            grad_fn = jaxcore.accumulate(grad_fn, module.accum_steps)
        hooks = [jaxcore.scale_grads(grad_scale)] if grad_scale != 1.0 else []
        if (hook := module.adapter.hooks.grads_fn(module)) is not None:
            hooks.append(hook)
        step = jaxcore.train_step(grad_fn, tx, hooks=hooks, nan_policy=module.nan_policy)
        k = 1 if window else module.steps_per_call
        if k > 1:
            step = jaxcore.k_steps(step, k)
        return jaxcore.jit_step(step, state_sharding=sharding)  # (the batch: as placed)

    def compile_train_step(self, module: Any, micro: int, state: Any, jbatch: Any) -> None:
        """Builds and AOT-compiles the train step; its statistics are logged after the first
        call is dispatched (their cost analysis is not on the way to the first step)."""
        module.compiled.train = step = self.build_train_step(module, micro, state)
        module.compiled.stats = step.compile(state, jbatch, dump_dir=module.hlo_dump_dir)
        module.compiled.stats_due = True

    def step_for(self, module: Any, micro: int, jbatch: Any) -> jaxcore.Step:
        """The compiled step for this call (a short or ragged accumulation window has its
        own)."""
        m = module.flags.accumulate
        ragged = isinstance(jbatch, MicroBatches)
        if m > 1 and (micro < m or ragged):
            short = module.compiled.short
            if (micro, ragged) not in short:
                short[micro, ragged] = self.build_train_step(
                    module, micro, module.state, grad_scale=micro / m, ragged=ragged
                )
            return short[micro, ragged]  # type: ignore[no-any-return]
        if module.compiled.train is None:
            self.compile_train_step(module, micro, module.state, jbatch)
        assert module.compiled.train is not None
        return module.compiled.train  # type: ignore[no-any-return]

    counts = False
    """Whether :meth:`counted` counts anything (else the module's training step skips it)."""

    def counted(self, module: Any) -> contextlib.AbstractContextManager[None]:
        """The context a ``training_step`` runs in (its optimizer steps counted by it)."""
        return contextlib.nullcontext()

    def align_logger_step(self, module: Any) -> None:
        """Where Lightning's logger step is set to the adapter's meaning (``logs``)."""
        module.adapter.logs.align_logger_step(module)

    def log_step(self, module: Any) -> int:
        """The logger step of the values of the step that just ran: the adapter's ``logs``
        (``global_step``; the Lightning port logs at Lightning's own step instead)."""
        return module.adapter.logs.log_step(module)  # type: ignore[no-any-return]

    def logging_step(self, module: Any, before: int) -> bool:
        """Whether the step that just ran (``before``: ``global_step`` before it) is a
        logging step: it completed a multiple of ``log_every_n_steps`` optimizer steps, as
        Lightning's ``(step + 1) % log_every_n_steps == 0``."""
        trainer = module._trainer  # (attached: no property walk per step)
        every = max(int(trainer.log_every_n_steps), 1)
        return bool(trainer.global_step // every > before // every)
