"""The port's optimizer group (``LightningAdapter.optim``): the user's ``configure_optimizers``
mapped onto optax (see :mod:`torchshell.optim._map`), its schedulers' learning rates kept in
step with the torch optimizers, ``ReduceLROnPlateau`` stepped on the monitored value.

The group owns what the mapping needs between hooks; its methods receive the
:class:`~torchshell.module.JaxModule` whose hooks call them (the protocol:
:class:`~torchshell.adapters.OptaxOptimizer`). Manual optimization's plan stays the
step group's (``adapter.steps``: :class:`~torchshell.port._manual_parts.LightningSteps`).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from torchshell._errors import ConfigError
from torchshell.adapters._optim import OptaxOptimizer
from torchshell.optim import MappedOptimizer, map_configure_optimizers
from torchshell.optim._rules import TorchOptState
from torchshell.optim._sched import parse_configure_optimizers

__all__ = ["LightningOptimizer"]


class LightningOptimizer(OptaxOptimizer):
    """The user's ``configure_optimizers``, mapped onto optax and handed to Lightning.

    Args:
        port: the traced user module (:class:`~torchshell.port._trace.LightningPort`).
    """

    def __init__(self, port: Any) -> None:
        self.port = port
        self.mapped: MappedOptimizer | None = None
        self.returned: Any = None  # configure_optimizers(): Lightning holds (and restores) it
        self.pristine: Any = None  # a copy as first returned: the schedule is mapped from it
        self.map_key: tuple[Any, ...] | None = None
        self.configs: list[Any] = []  # the schedulers' Lightning configs, as the user gave them
        self.lr_scale: np.ndarray | None = None  # per group: plateau factors (host copy)

    def configure_optimizers(self, module: Any) -> Any:
        """The user's own optimizer and schedulers, handed to Lightning as plain objects.

        Lightning never steps them (manual optimization): the JAX step applies the mapped
        update, and their ``lr`` is kept equal to the JAX schedule for ``LearningRateMonitor``
        (the schedulers' ``interval``/``frequency`` are set on Lightning's configs in
        :meth:`on_fit_start`, which manual optimization would otherwise warn about).
        """
        if module.tx is not None:
            return []
        self.configured(module)
        if (
            module.adapter.steps.manual
        ):  # the user's own return: its training_step steps them (by hand)
            return self.returned
        optimizer, configs = parse_configure_optimizers(self.returned)
        self.configs = configs
        return ([optimizer], [c.scheduler for c in configs]) if configs else optimizer

    def on_fit_start(self, module: Any) -> None:
        """The plateau factors start at 1 (not a resume); Lightning's scheduler configs get
        the user's ``interval``/``frequency``/``name``."""
        trainer = module.trainer
        if self.mapped is not None and trainer.ckpt_path is None:  # (plateau factors)
            self.lr_scale = np.ones(len(self.mapped.groups), np.float32)
        for mine, theirs in zip(trainer.lr_scheduler_configs, self.configs, strict=False):
            mine.interval, mine.frequency, mine.name = (
                theirs.interval,
                theirs.frequency,
                theirs.name,
            )

    def configured(self, module: Any) -> None:
        """Calls the user's ``configure_optimizers`` once, keeping a pristine copy.

        Lightning loads a checkpoint's optimizer and scheduler state into the returned
        objects; the JAX schedule is indexed by the restored step count, so it is mapped
        from the objects as they were before (the copy shares the module's parameters).
        """
        if self.returned is None:
            self.returned = self._user_configure_optimizers(module)
            shared = {id(p): p for p in self.port.module.parameters()}
            self.pristine = copy.deepcopy(self.returned, shared)

    def _user_configure_optimizers(self, module: Any) -> Any:
        """The user's ``configure_optimizers()``, with the Trainer attached and its own flags.

        Modules size schedules from ``self.trainer.estimated_stepping_batches``, which reads
        ``accumulate_grad_batches``: the user's value is put back for the call. The Trainer's
        ``model`` and ``lightning_module`` are the user's module for the call, as in plain
        Lightning (``torch.optim.Adam(self.trainer.model.parameters())``, the pattern
        Lightning's FSDP docs show, would otherwise get the JaxModule's empty list).
        """
        user, trainer = self.port.module, module._trainer
        if trainer is None:
            return user.configure_optimizers()
        # the Trainer attributes the run set aside (not the model summaries it took out)
        originals = {
            k: v for k, v in (module.run_scope.originals or {}).items() if hasattr(trainer, k)
        }
        neutral = {k: getattr(trainer, k) for k in originals}
        for k, v in originals.items():
            setattr(trainer, k, v)
        user.trainer = trainer
        strategy = trainer.strategy
        wrapped, bare = strategy._model, strategy._lightning_module
        strategy._model, strategy._lightning_module = user, user
        try:
            return user.configure_optimizers()
        finally:
            strategy._model, strategy._lightning_module = wrapped, bare
            for k, v in neutral.items():
                setattr(trainer, k, v)

    def remap(self, module: Any) -> None:
        """Maps anew for this run (the trainable parameters changed before the first step)."""
        self.map_key = None
        self.map(module, provisional=False)

    def map(self, module: Any, *, provisional: bool) -> None:
        """Maps ``configure_optimizers`` for the run's length (``provisional``: before the
        loaders exist, the state's structure only); the module's compiled steps are dropped
        when the tables change."""
        self.configured(module)
        if module.adapter.steps.manual:
            module.adapter.steps.map(module, provisional=provisional)
            return
        named = {
            k: v for k, v in self.port.module.named_parameters() if k in self.port.tracer.params0
        }
        trainer, m = module._trainer, module.flags.accumulate
        batches = None if trainer is None or provisional else trainer.num_training_batches
        if batches is None:  # before the loaders exist: the state's structure only
            per_epoch, total = 1, 1
        elif math.isinf(batches):  # an iterable loader: no epoch length
            assert trainer is not None  # (batches came from it)
            per_epoch, total = None, max(trainer.max_steps, 1)
        else:
            assert trainer is not None
            per_epoch = math.ceil(int(batches) / m)
            epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else 1
            total = trainer.max_steps if trainer.max_steps > 0 else per_epoch * epochs
        per_batches = None if batches is None or math.isinf(batches) else int(batches)
        key = (per_epoch, max(int(total), 1), m, per_batches)
        if key == self.map_key and self.mapped is not None:
            return  # (a later fit of the same run: the compiled step stays valid)
        self.map_key = key
        self.mapped = map_configure_optimizers(
            self.pristine,
            named,
            steps_per_epoch=per_epoch,
            total_steps=key[1],
            accumulate_grad_batches=m,
            batches_per_epoch=per_batches,
        )
        module.compiled.drop()  # the tables are constants of the compiled step
        self.lr_scale = np.ones(len(self.mapped.groups), np.float32)  # (plateau: host copy)

    def optimizer(self, module: Any) -> optax.GradientTransformation:
        """The mapped optimizer (or ``optimizer=``'s transform) after the Trainer's clipping;
        under manual optimization, the plan's optimizers."""
        steps = module.adapter.steps
        if steps.manual and module.tx is None:
            self.configured(module)
            return steps.plan(module).tx()  # type: ignore[no-any-return]
        if module.tx is None:
            if self.mapped is None:  # the state's structure; tables come at train start
                self.map(module, provisional=True)
            assert self.mapped is not None
            base = self.mapped.tx
        else:
            base = module.tx
        flags = module.flags
        if flags.clip_val is None:
            return base
        from torchshell.adapters._clip import torch_clip

        only = None if self.mapped is None else self.mapped.param_names
        return optax.chain(torch_clip(flags.clip_val, flags.clip_algorithm, only=only), base)

    def on_train_start(self, module: Any) -> None:
        """Refuses the lr finder; maps for the run's length (its loaders are known now)."""
        trainer = module.trainer
        if any(type(c).__name__ == "_LRCallback" for c in trainer.callbacks):
            raise ConfigError(
                "Lightning's learning-rate finder (Tuner.lr_find) sweeps the lr by swapping "
                "the torch optimizer's scheduler during fit; the compiled step runs the optax "
                "mapping of configure_optimizers() and would not follow it (a flat curve, a "
                "meaningless suggestion). Fix: choose the lr with a few short fits at "
                "different lr values, or run lr_find on the plain LightningModule."
            )
        if module.adapter.steps.manual:
            module.adapter.steps.check(module)
        if module.tx is None:
            self.map(module, provisional=False)
            if module._trainer is not None and trainer.is_global_zero and self.mapped:
                print(f"coreshell: optimizer {self.mapped.description} (mapped onto optax)")

    def sync_torch_lr(self, module: Any) -> None:
        """The torch optimizer's scheduled hyperparameters (``lr``, ``momentum``, ``betas``,
        ``weight_decay``: what a scheduler changes) follow the JAX schedule, as torch's
        scheduler leaves them after each step (LearningRateMonitor reads them)."""
        trainer = module.trainer
        if self.mapped is None or not trainer.optimizers:
            return
        assert self.lr_scale is not None  # (set with the mapping)
        optimizer, step = trainer.optimizers[0], trainer.global_step
        lrs = self._table_lrs(step)  # read on the host: no device work
        for index in self.mapped.lr_group:
            optimizer.param_groups[index]["lr"] = lrs[index] * float(self.lr_scale[index])
        for group, spec in zip(optimizer.param_groups, self.mapped.groups, strict=False):
            for key, table in spec.tables.items():
                value = float(table[min(step, len(table) - 1)])
                if key in ("beta1", "beta2") and "betas" in group:
                    betas = list(group["betas"])
                    betas[key == "beta2"] = value
                    group["betas"] = tuple(betas)
                elif key != "lr" and key in group:
                    group[key] = value

    def _table_lrs(self, step: int) -> list[float]:
        assert self.mapped is not None
        lrs = []
        for group in self.mapped.groups:
            table = group.tables.get("lr")
            lrs.append(
                float(group.const["lr"] if table is None else table[min(step, len(table) - 1)])
            )
        return lrs

    def step_plateau(self, module: Any) -> None:
        """Steps the user's ``ReduceLROnPlateau`` schedulers as Lightning does at an epoch's end.

        On the monitored value in ``callback_metrics`` (Lightning's ``strict`` rule when it
        is missing), every ``frequency`` epochs; the lr each group reaches becomes the JAX
        step's per-group factor on the tabulated lr (``TorchOptState.scale``, in the
        checkpointed state). The scheduler is the user's own object, which Lightning
        checkpoints and restores.
        """
        mapped = self.mapped
        if mapped is None or not mapped.plateau or module.tx is not None or module.state is None:
            return
        trainer = module.trainer
        optimizer = trainer.optimizers[0]
        tables = self._table_lrs(trainer.global_step)
        scale = _scale_of(module.state.opt_state)
        for group, lr, factor in zip(optimizer.param_groups, tables, scale, strict=True):
            if not math.isclose(group["lr"], lr * float(factor), rel_tol=1e-6):
                group["lr"] = lr * float(factor)  # the lr the step uses now (float32 tables)
        for index in mapped.plateau:
            config = self.configs[index]
            if (trainer.current_epoch + 1) % config.frequency:
                continue
            value = trainer.callback_metrics.get(config.monitor)
            if value is None:
                message = (
                    f"ReduceLROnPlateau monitors {config.monitor!r}, which is not among the "
                    f"logged values {sorted(trainer.callback_metrics)}"
                )
                if config.strict:
                    raise ConfigError(
                        f"{message}. Fix: log it (e.g. self.log({config.monitor!r}, ...) in "
                        "validation_step), or set 'monitor' in the lr_scheduler dict to one of "
                        "those."
                    )
                warnings.warn(
                    f"{message}; strict=False: the lr is not updated.", RuntimeWarning, stacklevel=2
                )
                continue
            config.scheduler.step(value)
        new = np.asarray(
            [
                g["lr"] / lr if lr else 1.0
                for g, lr in zip(optimizer.param_groups, tables, strict=True)
            ],
            np.float32,
        )
        self.lr_scale = new
        if not np.array_equal(new, scale):
            module.state = module.state.replace(opt_state=_with_scale(module.state.opt_state, new))


def _scale_of(opt_state: Any) -> np.ndarray:
    """The mapped optimizer's per-group lr factor (host copy) from a (chained) optax state."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TorchOptState)):
        if isinstance(node, TorchOptState) and node.scale is not None:
            return np.asarray(node.scale)
    raise ValueError("no TorchOptState with a scale in the optimizer state")


def _with_scale(opt_state: Any, scale: np.ndarray) -> Any:
    """``opt_state`` with the mapped optimizer's per-group lr factor replaced (same sharding)."""

    def put(node: Any) -> Any:
        if isinstance(node, TorchOptState) and node.scale is not None:
            value = jax.device_put(jnp.asarray(scale, jnp.float32), node.scale.sharding)
            return node._replace(scale=value)
        return node

    return jax.tree.map(put, opt_state, is_leaf=lambda x: isinstance(x, TorchOptState))
