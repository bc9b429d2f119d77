"""``configure_optimizers()`` -> an optax transformation with torch's update math.

The torch optimizer's param groups become groups of state_dict names (by parameter identity),
each with its own hyperparameters; schedulers become per-step tables (see ``_sched``); the
update math is torch's own (see ``_rules``). Anything that would not train the same way
is refused before training with a :class:`~torchshell._errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.types import LRSchedulerConfig

from torchshell._errors import ConfigError
from torchshell.optim._rules import (
    ADAGRAD,
    ADAM,
    ADAMAX,
    NADAM,
    RADAM,
    RMSPROP,
    SGD,
    GroupSpec,
    Rule,
    grouped,
)
from torchshell.optim._sched import (
    FIX,
    is_plateau,
    parse_configure_optimizers,
    read_group,
    run_schedule,
    simulate,
)

_HARMLESS = ("foreach", "fused", "differentiable", "capturable")
_BASE = {"lr", "weight_decay", "maximize", *_HARMLESS}
# torch class -> (rule, the hyperparameters the rule reads from every group)
_MAPPED: dict[type[torch.optim.Optimizer], tuple[Rule, frozenset[str]]] = {
    torch.optim.SGD: (SGD, frozenset({*_BASE, "momentum", "dampening", "nesterov"})),
    torch.optim.Adam: (
        ADAM,
        frozenset({*_BASE, "beta1", "beta2", "eps", "amsgrad", "decoupled_weight_decay"}),
    ),
    torch.optim.RMSprop: (
        RMSPROP,
        frozenset({*_BASE, "alpha", "eps", "momentum", "centered"}),
    ),
    torch.optim.Adagrad: (
        ADAGRAD,
        frozenset({*_BASE, "lr_decay", "initial_accumulator_value", "eps"}),
    ),
}
_MAPPED[torch.optim.AdamW] = _MAPPED[torch.optim.Adam]
_MAPPED[torch.optim.Adamax] = (ADAMAX, frozenset({*_BASE, "beta1", "beta2", "eps"}))
_MAPPED[torch.optim.NAdam] = (
    NADAM,
    frozenset({*_BASE, "beta1", "beta2", "eps", "momentum_decay", "decoupled_weight_decay"}),
)
_MAPPED[torch.optim.RAdam] = (
    RADAM,
    frozenset({*_BASE, "beta1", "beta2", "eps", "decoupled_weight_decay"}),
)
_FLAGS = {"maximize", "nesterov", "amsgrad", "centered", "decoupled_weight_decay", *_HARMLESS}


@dataclasses.dataclass(frozen=True)
class Source:
    """A private copy of the returned optimizer and schedulers, and how Lightning steps them."""

    optimizer: torch.optim.Optimizer
    configs: tuple[LRSchedulerConfig, ...]
    stepping: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class MappedOptimizer:
    """The optax side of a LightningModule's ``configure_optimizers()``.

    Attributes:
        tx: ``update(grads, state, params)`` with torch's math on flat ``{name: array}`` params;
            its state counts optimizer steps (``state.step``) and indexes the lr tables.
        lr_names: the names Lightning's ``LearningRateMonitor`` logs (``"lr-SGD"``,
            ``"lr-AdamW/pg1"``...), one per param group (per scheduler, as Lightning does).
        groups: the param groups (names, constant and scheduled hyperparameters).
        lr_group: for each of ``lr_names``, the index of its param group.
        description: one line for the console.
        torch_names: per torch param group, the state_dict name of each of its parameters in
            torch's order (``None``: not trainable); what the optimizer state converters use.
        source: a private snapshot of the optimizer and schedulers as returned (for
            :func:`~torchshell.optim._state.state_to_torch`).
        plateau: the indices of the ``ReduceLROnPlateau`` configs: the host steps them after
            validation and sets ``tx``'s per-group lr factor (``TorchOptState.scale``).
    """

    tx: optax.GradientTransformation
    lr_names: tuple[str, ...]
    groups: tuple[GroupSpec, ...]
    lr_group: tuple[int, ...]
    description: str
    torch_names: tuple[tuple[str | None, ...], ...] = ()
    source: Source | None = dataclasses.field(default=None, repr=False, compare=False)
    plateau: tuple[int, ...] = ()  # indices of the configs that step on a monitored metric

    @property
    def param_names(self) -> frozenset[str]:
        """The state_dict names the optimizer updates (those in one of its param groups)."""
        return frozenset(n for g in self.groups for n in g.names)

    def lrs(self, step: jax.Array | int) -> dict[str, jax.Array]:
        """The lr of each of ``lr_names`` used at optimizer step ``step`` (0-based); jittable.

        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> m = map_configure_optimizers(opt, {"w": w}, steps_per_epoch=None, total_steps=4)
        >>> {k: float(v) for k, v in m.lrs(3).items()}
        {'lr-SGD': 0.10000000149011612}
        """
        return {
            name: jnp.asarray(self.groups[i].at(step)["lr"], jnp.float32)
            for name, i in zip(self.lr_names, self.lr_group, strict=True)
        }


def map_configure_optimizers(
    returned: Any,
    named_params: Mapping[str, torch.nn.Parameter],
    *,
    steps_per_epoch: int | None,
    total_steps: int,
    accumulate_grad_batches: int = 1,
    batches_per_epoch: int | None = None,
) -> MappedOptimizer:
    """Map what ``configure_optimizers()`` returned onto optax, with torch's update math.

    Mapped: ``SGD``, ``Adam`` (also ``decoupled_weight_decay=True``), ``AdamW``, ``RMSprop``,
    ``Adagrad``, ``Adamax``, ``NAdam``, ``RAdam``, exactly by class, each param group with its
    own hyperparameters; any ``torch.optim.lr_scheduler.LRScheduler``, stepped on a private
    copy as Lightning's loop steps it (``interval``, ``frequency``, several schedulers in
    order); ``ReduceLROnPlateau`` (per epoch) through a per-group lr factor the host sets.
    Every hyperparameter a scheduler moves becomes a per-step table: ``lr``, and the
    ``momentum`` / ``betas[0]`` that ``OneCycleLR`` and ``CyclicLR`` cycle.

    Not seen here: a user override of ``LightningModule.lr_scheduler_step`` (the caller must
    refuse it), and torch skipping parameters whose ``.grad`` is ``None`` (JAX gives them zero
    gradients, so momentum, Adam moments and decoupled decay still move them).

    Args:
        returned: the value of ``lit_module.configure_optimizers()``, any form Lightning takes.
        named_params: trainable parameters by state_dict name (the keys of the JAX params).
        steps_per_epoch: optimizer steps per epoch (``None``: unknown, an iterable loader).
        total_steps: optimizer steps the run will take (the length of the lr tables; later
            steps reuse the last entry).
        accumulate_grad_batches: Lightning's flag (it shifts when ``"step"`` schedulers with a
            ``frequency`` fire).
        batches_per_epoch: batches per epoch, when accumulation leaves a short last step.

    Returns:
        The :class:`MappedOptimizer`.

    Raises:
        ConfigError: an optimizer, scheduler, flag or return form that does not map.

    >>> import jax.numpy as jnp, optax
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> m = map_configure_optimizers(
    ...     {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}},
    ...     dict(net.named_parameters()), steps_per_epoch=None, total_steps=3)
    >>> m.description, m.lr_names
    ('AdamW + StepLR per step', ('lr-AdamW',))
    >>> [round(float(m.lrs(s)["lr-AdamW"]), 6) for s in range(4)]
    [0.01, 0.005, 0.0025, 0.0025]
    >>> params = {k: jnp.asarray(v.detach().numpy()) for k, v in net.named_parameters()}
    >>> grads = {k: jnp.ones_like(v) for k, v in params.items()}
    >>> updates, state = m.tx.update(grads, m.tx.init(params), params)
    >>> int(state.step)
    1
    """
    optimizer, configs = parse_configure_optimizers(returned)
    cls = type(optimizer)
    if cls not in _MAPPED:
        known = ", ".join(sorted({c.__name__ for c in _MAPPED}))
        raise ConfigError(
            f"the optimizer {cls.__module__}.{cls.__qualname__} has no exact optax mapping "
            f"(mapped: {known}); use one of those, or {FIX}"
        )
    rule, keys = _MAPPED[cls]
    name_of = {id(p): n for n, p in named_params.items()}
    stepping: dict[str, Any] = {
        "steps_per_epoch": steps_per_epoch,
        "accumulate_grad_batches": accumulate_grad_batches,
        "batches_per_epoch": batches_per_epoch,
    }
    if configs:
        records = simulate(optimizer, configs, total_steps=total_steps, **stepping)
    else:
        records = [{k: [v] for k, v in read_group(g).items()} for g in optimizer.param_groups]
    groups = []
    for index, (group, record) in enumerate(zip(optimizer.param_groups, records, strict=True)):
        names = tuple(name_of[id(p)] for p in group["params"] if id(p) in name_of)
        groups.append(_group_spec(optimizer, index, names, record, keys, _cycled(configs)))
    lr_names, lr_group = _lr_names(optimizer, configs)
    _, opt_copy, sched_copies = run_schedule(optimizer, configs, total_steps=0, **stepping)
    source = Source(
        opt_copy,
        tuple(
            dataclasses.replace(c, scheduler=s) for c, s in zip(configs, sched_copies, strict=True)
        ),
        stepping,
    )
    plateau = tuple(i for i, c in enumerate(configs) if is_plateau(c))
    return MappedOptimizer(
        tx=grouped(rule, groups, scaled=bool(plateau)),
        lr_names=lr_names,
        groups=tuple(groups),
        lr_group=lr_group,
        description=_describe(optimizer, configs),
        torch_names=tuple(
            tuple(name_of.get(id(p)) for p in g["params"]) for g in optimizer.param_groups
        ),
        source=source,
        plateau=plateau,
    )


def _group_spec(
    optimizer: torch.optim.Optimizer,
    index: int,
    names: tuple[str, ...],
    record: Mapping[str, list[Any]],
    keys: frozenset[str],
    cycled: frozenset[str],
) -> GroupSpec:
    cls = type(optimizer).__name__
    const: dict[str, Any] = {}
    tables: dict[str, np.ndarray] = {}
    for key, values in record.items():
        if key not in keys:
            if key in optimizer.defaults and values[0] not in (None, False, 0):
                raise ConfigError(
                    f"{cls} param group {index} sets {key}={values[0]!r}, which from_lightning "
                    f"does not map (it may change the update math); drop it, or {FIX}"
                )
            continue  # a key of the user's own (e.g. "name")
        if key in _HARMLESS:
            continue
        first = values[0]
        if key not in cycled and all(v == first for v in values):
            const[key] = bool(first) if key in _FLAGS else float(first)
        elif key in _FLAGS:
            raise ConfigError(f"{cls} param group {index}: a scheduler changes the flag {key}")
        else:
            tables[key] = np.asarray(values, np.float64).astype(np.float32)
    missing = keys - set(record) - set(_HARMLESS)
    for key in missing:  # e.g. decoupled_weight_decay on AdamW of an older torch
        const[key] = cls == "AdamW" if key == "decoupled_weight_decay" else False
    if cls == "AdamW":
        const["decoupled_weight_decay"] = True
    return GroupSpec(names, const, tables)


def _cycled(configs: list[LRSchedulerConfig]) -> frozenset[str]:
    """Hyperparameters a scheduler may move, tabulated even when they look constant.

    The optimizer state's structure (a momentum buffer or not) must not depend on how many
    steps were tabulated: a cycling scheduler's momentum is a table from the start.
    """
    pending = [c.scheduler for c in configs]
    while pending:
        sched = pending.pop()
        if getattr(sched, "cycle_momentum", False):
            return frozenset({"lr", "momentum", "beta1"})
        pending.extend(getattr(sched, "_schedulers", ()))
    return frozenset({"lr"}) if configs else frozenset()


def _lr_names(
    optimizer: torch.optim.Optimizer, configs: list[LRSchedulerConfig]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Lightning's LearningRateMonitor naming (its own code), one name per group per config."""
    monitor = LearningRateMonitor()
    if configs:
        per_config, _, _ = monitor._find_names_from_schedulers(configs)
    else:
        per_config, _ = monitor._find_names_from_optimizers([optimizer], [], defaultdict(int))
    names = tuple(n for config_names in per_config for n in config_names)
    groups = tuple(i for config_names in per_config for i in range(len(config_names)))
    return names, groups


def _describe(optimizer: torch.optim.Optimizer, configs: list[LRSchedulerConfig]) -> str:
    n = len(optimizer.param_groups)
    text = type(optimizer).__name__ + (f" ({n} param groups)" if n > 1 else "")
    for c in configs:
        every = f" every {c.frequency} {c.interval}s" if c.frequency > 1 else f" per {c.interval}"
        text += f" + {type(c.scheduler).__name__}{every}"
    return text
