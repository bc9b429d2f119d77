"""The port's step group (``LightningAdapter.steps``): what ``JaxModule.from_lightning`` does
under the user's manual optimization (``automatic_optimization = False``): the plan of several
optimizers, its compiled step (:func:`~torchshell.port._manual.manual_step`), ``global_step``
counting ``opt.step()`` calls, and each optimizer's and scheduler's state in the ``.ckpt``;
under automatic optimization, the default step kept with the Trainer values its trace read.

The group owns the manual state between hooks; its methods receive the
:class:`~torchshell.module.JaxModule` whose hooks call them (the protocol:
:class:`~torchshell.adapters.TrainSteps`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax

import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._batches import MicroBatches
from torchshell.adapters._steps import TrainSteps
from torchshell.port._host_reads import reads_hold, reusable, watching_trainer
from torchshell.port._logs import STEP_KEY
from torchshell.port._manual import manual_step
from torchshell.port._manual_optim import ManualPlan, map_manual

__all__ = ["MANUAL_REFUSED", "LightningSteps"]

# Hooks Lightning runs around manual_backward / opt.step (on_before_backward, backward,
# on_after_backward, on_before_optimizer_step): the stand-ins do not run them. Others it never
# runs under manual optimization (optimizer_step, on_before_zero_grad, lr_scheduler_step,
# configure_gradient_clipping), here neither.
MANUAL_REFUSED = ("backward", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
_NOT_COUNTED = contextlib.nullcontext()  # (automatic optimization: Lightning's own count)


class LightningSteps(TrainSteps):
    """The user's manual optimization, and the compiled steps kept with the Trainer values
    their traces read (see the module docstring).

    Args:
        port: the traced user module (:class:`~torchshell.port._trace.LightningPort`).
    """

    def __init__(self, port: Any) -> None:
        self.port = port
        self.total: int | None = None  # the step count the manual plan was made for
        # compiled steps, with the Trainer values each was traced with
        self.host_steps: list[tuple[dict[str, Any], Any]] = []
        self.counts = True  # counted asked every batch (decided at each fit's setup: manual)

    @property
    def manual(self) -> bool:
        """The user's module steps its optimizers itself."""
        return not self.port.module.automatic_optimization

    def check(self, module: Any) -> None:
        """Refuses what manual optimization cannot be combined with, naming it and the fix."""
        owner = type(self.port.module).__name__
        custom = [hook for hook in MANUAL_REFUSED if self.port.overrides(hook)]
        if custom:
            raise ConfigError(
                f"{owner} overrides {custom} under manual optimization: Lightning runs them "
                "inside manual_backward/opt.step, where from_lightning's compiled step does not "
                "(its gradients are not torch .grad tensors). Fix: remove the override, or "
                "move its code into training_step (e.g. self.clip_gradients(opt, ...))."
            )
        if module.tx is not None:
            raise ConfigError(
                f"{owner} uses manual optimization and optimizer= was given: its training_step "
                "steps its own optimizers. Fix: drop optimizer=, or return the loss with "
                "automatic optimization."
            )
        flags = module.flags
        if flags.accumulate > 1 or flags.clip_val is not None:
            raise ConfigError(
                f"{owner} uses manual optimization with Trainer(accumulate_grad_batches="
                f"{flags.accumulate}, gradient_clip_val={flags.clip_val}), which "
                "Lightning refuses too. Fix: clip in training_step with self.clip_gradients("
                "opt, gradient_clip_val=...), and drop accumulate_grad_batches."
            )
        if module.steps_per_call > 1 or module.accum_steps > 1:
            raise ConfigError(
                f"{owner} uses manual optimization with steps_per_call={module.steps_per_call}, "
                f"accum_steps={module.accum_steps}. Fix: set both to 1."
            )

    def map(self, module: Any, *, provisional: bool) -> None:
        """Maps the user's optimizers; schedulers tabulated for the run's batches (a few
        ``sch.step()`` calls per batch at most; later calls keep the last value)."""
        trainer = module._trainer
        batches = None if trainer is None or provisional else trainer.num_training_batches
        total = 1
        if batches is not None and trainer is not None:
            if trainer.max_steps > 0:
                total = trainer.max_steps
            elif not math.isinf(batches):
                epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else 1
                total = int(batches) * epochs
        if self.port.manual_plan is not None and self.total == total:
            return
        self.total = total
        named = {
            k: v for k, v in self.port.module.named_parameters() if k in self.port.tracer.params0
        }
        pristine = module.adapter.optim.pristine  # (configure_optimizers() as first returned)
        self.port.manual_plan = map_manual(pristine, named, total_steps=4 * total + 1)
        module.compiled.train = None  # the tables are constants of the compiled step
        self.host_steps.clear()
        if trainer is not None and not provisional and trainer.is_global_zero:
            names = ", ".join(m.description for m in self.port.manual_plan.mapped)
            print(f"coreshell: manual optimization, optimizers {names} (mapped onto optax)")

    def plan(self, module: Any) -> ManualPlan:
        """The mapped optimizers (mapped on first use)."""
        if self.port.manual_plan is None:
            self.map(module, provisional=True)
        plan: ManualPlan = self.port.manual_plan
        return plan

    def build_train_step(
        self, module: Any, micro: int, state: Any, grad_scale: float = 1.0, ragged: bool = False
    ) -> jaxcore.Step:
        """The default step (:meth:`TrainSteps.build_train_step`) under automatic
        optimization; under manual optimization, the user's ``training_step`` stepping the
        mapped optimizers itself (:func:`~torchshell.port._manual.manual_step`)."""
        if not self.manual:
            return super().build_train_step(module, micro, state, grad_scale, ragged)
        self.check(module)
        return manual_step(
            self.port,
            self.plan(module),
            state_sharding=jaxcore.state_shardings(state),
            nan_policy=module.nan_policy,
        )

    def compile_train_step(self, module: Any, micro: int, state: Any, jbatch: Any) -> None:
        """Each compiled step is kept with the Trainer values its trace read
        (``is_last_batch``...: :mod:`torchshell.port._host_reads`); those traced with values
        that cannot come back (an earlier epoch's) are freed."""
        self.port.host_reads = {}
        module.adapter.hooks.ahead = True  # (what training_step returns: known anew)
        jbatch = self.with_step(module, jbatch)
        if self.manual:  # (watched inside the manual step's own trace)
            super().compile_train_step(module, micro, state, jbatch)
        else:
            with watching_trainer(self.port.host_reads):
                super().compile_train_step(module, micro, state, jbatch)
        reads = dict(self.port.host_reads)
        self.host_steps[:] = [*reusable(self.host_steps, reads), (reads, module.compiled.train)]

    def step_for(self, module: Any, micro: int, jbatch: Any) -> jaxcore.Step:
        """The compiled step traced with the Trainer values of this batch (traced anew for
        values none was traced with)."""
        compiled = module.compiled
        if compiled.train is None:  # rebuilt (new flags, a new optimizer): none holds
            self.host_steps.clear()
        elif self.host_steps and self.host_steps[0][0]:  # (no reads: the one program)
            found = (s for reads, s in self.host_steps if reads_hold(module.trainer, reads))
            compiled.train = next(found, None)
        if compiled.train is not None and module.flags.accumulate == 1:
            return compiled.train  # type: ignore[no-any-return]  # (one batch: no window)
        step = super().step_for(module, micro, jbatch)
        if not self.window_reads_step(module, jbatch):
            return step
        with_step = functools.partial(self.with_step, module)
        return _StepWithCount(step, with_step)  # type: ignore[return-value]

    def window_reads_step(self, module: Any, jbatch: Any) -> bool:
        """An accumulation window's batches, stacked or not, and ``training_step`` reads
        ``global_step`` (a single batch has it already: ``LightningPort.specialise``)."""
        has = isinstance(jbatch, Mapping) and STEP_KEY in jbatch
        return self.port.reads_step and module.flags.accumulate > 1 and not has

    def with_step(self, module: Any, jbatch: Any) -> Any:
        """The window's batches with the Trainer's ``global_step`` beside them (the same for
        each: one optimizer step), when ``training_step`` reads it."""
        if not self.window_reads_step(module, jbatch):
            return jbatch
        if isinstance(jbatch, MicroBatches):  # (shapes differ: each its own batch)
            return MicroBatches(self.port.with_step(b) for b in jbatch)
        return self.port.with_step(jbatch, micro=len(jax.tree.leaves(jbatch)[0]))

    def counted(self, module: Any) -> contextlib.AbstractContextManager[None]:
        """Under manual optimization ``global_step`` counts ``opt.step()`` calls, as in
        Lightning (two optimizers stepped: two per batch); else nothing to count."""
        if self.port.module.automatic_optimization:
            return _NOT_COUNTED
        return self._counting(module)

    @contextlib.contextmanager
    def _counting(self, module: Any) -> Iterator[None]:
        progress = module.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        before = progress.total.completed
        yield
        n = self.port.manual_steps
        progress.total.ready = progress.total.completed = before + n
        progress.current.ready = progress.current.completed = progress.current.completed - 1 + n

    # -- logging: Lightning's logger step under manual optimization counts batches ----------
    def align_logger_step(self, module: Any) -> None:
        """Lightning's logger step during a batch is the optimizer steps before it, as in a
        plain automatic-optimization run (Lightning counts this module's batches, as it
        steps no torch optimizer): so what ``self.log`` logs in an epoch-end hook lands at
        the step plain Lightning gives it, also under ``accumulate_grad_batches``. Under
        manual optimization Lightning's own count, batches, is the logger step: left."""
        trainer = module._trainer
        if trainer is not None and self.port.module.automatic_optimization:
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step

    def log_step(self, module: Any) -> int:
        """Under manual optimization plain Lightning logs a batch's values at the batches
        before it (however many ``opt.step()`` calls each made)."""
        if not self.manual:
            return super().log_step(module)
        return int(module.trainer.fit_loop.epoch_loop._batches_that_stepped)

    def logging_step(self, module: Any, before: int) -> bool:
        """Whether the step that just ran logs: it completed a multiple of
        ``log_every_n_steps`` optimizer steps (``before``: ``global_step`` before it), as
        :meth:`TrainSteps.logging_step`; under manual optimization every
        ``log_every_n_steps``-th batch, as Lightning."""
        trainer = module._trainer
        every = max(int(trainer.log_every_n_steps), 1)
        if self.port.module.automatic_optimization:
            return bool(trainer.global_step // every > before // every)
        return (int(trainer.fit_loop.epoch_loop._batches_that_stepped) + 1) % every == 0

    def host_schedulers(self, module: Any) -> Any:
        """``self.lr_schedulers()`` in the user's host hooks (``on_train_epoch_end``...) under
        manual optimization: each one's ``step()`` steps the torch scheduler and moves the
        compiled step's schedule of its optimizer one entry on, as the traced
        ``sch.step()`` does."""
        configs, plan = module.trainer.lr_scheduler_configs, self.plan(module)
        pairs = zip(configs, plan.sched_opt, strict=True)
        out = [_HostScheduler(self, module, c.scheduler, i) for c, i in pairs]
        return (out[0] if len(out) == 1 else out) or None

    def step_schedule(self, module: Any, opt_index: int) -> None:
        """One ``sch.step()`` of optimizer ``opt_index``'s scheduler, on the JAX state."""
        if module.state is None:
            return
        synced = module.held.synced is module.state
        opt_state = list(module.state.opt_state)
        own = opt_state[opt_index]
        opt_state[opt_index] = own._replace(sched=own.sched + 1)
        module.state = module.state.replace(opt_state=tuple(opt_state))
        if synced:  # (the weights did not change)
            module.held.synced = module.state

    def save_optimizers(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """Each optimizer's and scheduler's state as plain Lightning writes them."""
        opt_state = jax.device_get(module.state.opt_state)
        optimizers, schedulers = self.plan(module).to_torch(opt_state)
        checkpoint["optimizer_states"] = optimizers
        checkpoint["lr_schedulers"] = schedulers

    def restore_optimizers(self, module: Any, state: Any, checkpoint: Mapping[str, Any]) -> Any:
        """``state.opt_state`` from a plain Lightning checkpoint's optimizer and scheduler
        states."""
        opt_state = self.plan(module).from_torch(
            checkpoint.get("optimizer_states", ()),
            checkpoint.get("lr_schedulers", ()),
            state.params,
        )
        shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
        return state.replace(opt_state=jax.device_put(opt_state, shardings))


class _HostScheduler:
    """A scheduler as the user's host hooks see it under manual optimization."""

    def __init__(self, steps: LightningSteps, module: Any, scheduler: Any, opt_index: int) -> None:
        self._steps, self._module = steps, module
        self._scheduler, self._opt_index = scheduler, opt_index

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Steps the torch scheduler and the compiled step's schedule."""
        if args or kwargs:
            raise ConfigError(
                "scheduler.step(value) in a hook: from_lightning maps schedulers stepped "
                "without arguments. Fix: call sch.step() with none."
            )
        # (its optimizer was stepped, in the compiled step: torch's order check passes)
        self._scheduler.optimizer._opt_called = True
        self._scheduler.step()
        self._steps.step_schedule(self._module, self._opt_index)

    def __getattr__(self, name: str) -> Any:  # get_last_lr(), state_dict(), ...
        return getattr(self._scheduler, name)


class _StepWithCount:
    """A compiled step called with the window's ``global_step`` added to its batch."""

    def __init__(self, step: Any, with_step: Any) -> None:
        self._step, self._with_step = step, with_step

    def __call__(self, state: Any, jbatch: Any) -> Any:
        return self._step(state, self._with_step(jbatch))

    def __getattr__(self, name: str) -> Any:  # (recompiles, compile, ...)
        return getattr(self._step, name)
