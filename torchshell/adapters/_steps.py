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

    def make_train_step(
        self, module: Any, micro: int, state: Any, grad_scale: float = 1.0, ragged: bool = False
    ) -> jaxcore.Step:
        """The train step for ``state`` (the state, or its abstract twin while it inits)."""
        window = module.flags.accumulate > 1
        return jaxcore.make_train_step(
            module.model_fns,
            module.loss_fn,
            module.optimizer(),
            state_sharding=jaxcore.state_shardings(state),
            batch_sharding=None,  # the arrays' own (placed by the bridge)
            steps_per_call=1 if window else module.steps_per_call,
            accum_steps=micro if window else module.accum_steps,
            stacked_micro=window,
            grad_scale=grad_scale,
            compute_dtype=module._compute_dtype,
            nan_policy=module.nan_policy,
            weigh_rows=module.adapter.weigh_rows,
            unrolled_micro=ragged,
            per_micro=window and not module.adapter.weigh_rows,  # Lightning's per-batch self.log
            grads_fn=module.adapter.hooks.grads_fn(module),
        )

    def compile_train_step(self, module: Any, micro: int, state: Any, jbatch: Any) -> None:
        """Builds and AOT-compiles the train step; its statistics are logged after the first
        call is dispatched (their cost analysis is not on the way to the first step)."""
        module.compiled.train = step = self.make_train_step(module, micro, state)
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
                short[micro, ragged] = self.make_train_step(
                    module, micro, module.state, grad_scale=micro / m, ragged=ragged
                )
            return short[micro, ragged]  # type: ignore[no-any-return]
        if module.compiled.train is None:
            self.compile_train_step(module, micro, module.state, jbatch)
        assert module.compiled.train is not None
        return module.compiled.train  # type: ignore[no-any-return]

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
        every = max(int(module.trainer.log_every_n_steps), 1)
        return bool(module.trainer.global_step // every > before // every)
