"""Manual optimization's optimizers: each one ``configure_optimizers`` returned, mapped onto
torch's update math, its schedulers counted by the user's own ``scheduler.step()`` calls.

Under ``automatic_optimization = False`` Lightning never steps anything: ``training_step``
calls ``opt.step()`` and ``sch.step()`` itself. Each optimizer becomes a
:class:`~torchshell.optim._map.MappedOptimizer` (the same math and param groups as the
automatic path); a scheduler's hyperparameter tables are indexed by how many times the user
stepped it (:class:`ManualOptState.sched`), the optimizer's own step count by its
``opt.step()`` calls (:class:`ManualOptState.opt`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_manual_opt,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from torchshell._errors import ConfigError
from torchshell.optim import state_from_torch, state_to_torch
from torchshell.optim._map import _MAPPED, MappedOptimizer, map_configure_optimizers
from torchshell.optim._rules import Rule, Slots, TorchOptState
from torchshell.optim._sched import FIX, is_plateau, run_schedule

__all__ = ["ManualOptState", "ManualPlan", "map_manual"]


class ManualOptState(NamedTuple):
    """One optimizer's state under manual optimization.

    Attributes:
        opt: the mapped optimizer's state; ``opt.step`` counts its ``opt.step()`` calls.
        sched: how many times the user stepped this optimizer's scheduler (int32): it
            indexes the hyperparameter tables.
    """

    opt: TorchOptState
    sched: jax.Array


@dataclasses.dataclass(frozen=True)
class ManualPlan:
    """The optax side of ``configure_optimizers()`` under manual optimization.

    Attributes:
        mapped: one :class:`MappedOptimizer` per optimizer, in the order returned.
        rules: each optimizer's update rule (torch's math).
        single: one optimizer was returned (``self.optimizers()`` gives it, not a list).
        sched_opt: per scheduler (in Lightning's order), the index of its optimizer.
    """

    mapped: tuple[MappedOptimizer, ...]
    rules: tuple[Rule, ...]
    single: bool
    sched_opt: tuple[int, ...]

    def tx(self) -> optax.GradientTransformation:
        """The state's init (``update`` is never called: the traced step applies them)."""

        def init(params: Any) -> tuple[ManualOptState, ...]:
            return tuple(
                ManualOptState(m.tx.init(params), jnp.zeros([], jnp.int32)) for m in self.mapped
            )

        def update(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("manual optimization applies its updates in the step")

        return optax.GradientTransformation(init, update)  # type: ignore[arg-type]

    def apply(
        self,
        index: int,
        state: ManualOptState,
        grads: Mapping[str, jax.Array],
        params: Mapping[str, jax.Array],
    ) -> tuple[dict[str, jax.Array], ManualOptState]:
        """One ``opt.step()`` of optimizer ``index``: the new values of the parameters that
        have a gradient (torch skips the others), and the new state."""
        mapped, rule = self.mapped[index], self.rules[index]
        opt = state.opt
        t = (opt.step + 1).astype(jnp.float32)
        new: dict[str, jax.Array] = {}
        slots: dict[str, Slots] = dict(opt.slots)
        for group in mapped.groups:
            hp: dict[str, Any] = dict(group.at(state.sched))
            hp["_scheduled"] = tuple(group.tables)
            for name in group.names:
                if name not in grads:
                    continue
                p = params[name]
                update, slots[name] = rule.step(grads[name], p, opt.slots[name], hp, t)
                new[name] = (p + update.astype(p.dtype)).astype(p.dtype)
        opt = TorchOptState(optax.safe_increment(opt.step), slots, opt.scale)
        return new, ManualOptState(opt, state.sched)

    def lrs(self, index: int, state: ManualOptState) -> list[jax.Array]:
        """Each param group's lr of optimizer ``index`` now (``get_last_lr()``)."""
        return [
            jnp.asarray(g.at(state.sched)["lr"], jnp.float32) for g in self.mapped[index].groups
        ]

    def to_torch(
        self, states: Sequence[ManualOptState]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ``.ckpt``'s ``optimizer_states`` and ``lr_schedulers`` as plain Lightning writes
        them for these states."""
        optimizers: list[dict[str, Any]] = []
        schedulers: list[dict[str, Any]] = []
        for mapped, state in zip(self.mapped, states, strict=True):
            sched = int(state.sched)
            sd, _ = state_to_torch(mapped, state.opt)  # (the slots after `steps` steps)
            source = mapped.source
            assert source is not None  # (map_configure_optimizers keeps one)
            _, opt_copy, sched_copies = run_schedule(
                source.optimizer, list(source.configs), total_steps=sched, **source.stepping
            )
            sd["param_groups"] = opt_copy.state_dict()["param_groups"]
            optimizers.append(sd)
            schedulers.extend(s.state_dict() for s in sched_copies)
        return optimizers, schedulers

    def from_torch(
        self,
        optimizer_states: Sequence[Mapping[str, Any]],
        scheduler_states: Sequence[Mapping[str, Any]],
        params: Mapping[str, jax.Array],
    ) -> tuple[ManualOptState, ...]:
        """The states a plain Lightning ``.ckpt`` of the same module resumes from."""
        if len(optimizer_states) != len(self.mapped):
            raise ConfigError(
                f"the checkpoint holds {len(optimizer_states)} optimizer states, this module's "
                f"configure_optimizers() returns {len(self.mapped)} optimizers. Fix: resume "
                "from a checkpoint of the same module."
            )
        counts = [0] * len(self.mapped)
        for opt_index, sd in zip(self.sched_opt, scheduler_states, strict=False):
            counts[opt_index] = int(sd.get("last_epoch", 0))
        out = []
        for mapped, sd, sched in zip(self.mapped, optimizer_states, counts, strict=True):
            opt = state_from_torch(mapped, sd, params)
            out.append(ManualOptState(opt, jnp.asarray(sched, jnp.int32)))
        return tuple(out)


def map_manual(
    returned: Any, named_params: Mapping[str, torch.nn.Parameter], *, total_steps: int
) -> ManualPlan:
    """Maps ``configure_optimizers()`` for manual optimization: several optimizers, each its
    own schedulers stepped by hand.

    Args:
        returned: what ``configure_optimizers()`` returned (any form Lightning takes).
        named_params: trainable parameters by state_dict name.
        total_steps: scheduler steps to tabulate (later ones reuse the last entry).

    Returns:
        The :class:`ManualPlan`.

    Raises:
        ConfigError: an optimizer or scheduler that does not map.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> g, d = (torch.optim.Adam([net.weight], lr=1e-3), torch.optim.SGD([net.bias], lr=0.1))
        >>> plan = map_manual([g, d], dict(net.named_parameters()), total_steps=4)
        >>> [m.description for m in plan.mapped], plan.single
        (['Adam', 'SGD'], False)
    """
    if returned is None:
        raise ConfigError(
            "configure_optimizers() returned None: from_lightning needs the torch optimizers "
            f"to map onto optax; return them from configure_optimizers, or {FIX}"
        )
    try:
        optimizers, schedulers, _ = _configure_optimizers(returned)
        configs = _configure_schedulers_manual_opt(schedulers)
    except MisconfigurationException as err:
        raise ConfigError(
            f"configure_optimizers() returned a value Lightning cannot use: {err}; "
            f"return a form Lightning accepts, or {FIX}"
        ) from err
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    sched_opt = []
    for config in configs:
        owner = getattr(config.scheduler, "optimizer", None)
        found = [i for i, o in enumerate(optimizers) if o is owner]
        if not found or is_plateau(config):
            why = (
                "ReduceLROnPlateau steps on a monitored value"
                if found
                else "it drives none of the returned optimizers"
            )
            raise ConfigError(
                f"the lr scheduler {type(config.scheduler).__name__} cannot be stepped inside "
                f"the compiled step under manual optimization: {why}. Fix: use a scheduler "
                f"whose step() takes no value (StepLR, OneCycleLR, LambdaLR...), or {FIX}"
            )
        sched_opt.append(found[0])
    mapped, rules = [], []
    for index, optimizer in enumerate(optimizers):
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = {k: v for k, v in named_params.items() if id(v) in ids}
        own = [c.scheduler for c, i in zip(configs, sched_opt, strict=True) if i == index]
        if len(own) > 1:
            raise ConfigError(
                f"optimizer {index} ({type(optimizer).__name__}) has {len(own)} lr schedulers; "
                "under manual optimization from_lightning maps one per optimizer. Fix: chain "
                f"them into one (torch.optim.lr_scheduler.SequentialLR), or {FIX}"
            )
        form: Any = optimizer
        if own:
            form = {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": own[0], "interval": "step"},
            }
        mapped.append(
            map_configure_optimizers(form, named, steps_per_epoch=None, total_steps=total_steps)
        )
        rules.append(_MAPPED[type(optimizer)][0])  # (mapped: map_configure_optimizers checked)
    return ManualPlan(tuple(mapped), tuple(rules), len(optimizers) == 1, tuple(sched_opt))
