"""optax optimizers from plain keyword arguments."""

from __future__ import annotations

import optax

from jaxcore._errors import ConfigError

_OPTIMIZERS = ("adamw", "adam", "sgd", "lion")
_SCHEDULES = ("constant", "cosine")


def make_schedule(
    lr: float, *, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 0
) -> optax.Schedule:
    """Learning-rate schedule: linear warmup then constant or cosine decay.

    Example:
        >>> s = make_schedule(1e-3, schedule="cosine", warmup_steps=10, total_steps=100)
        >>> round(float(s(10)), 6)  # the peak, after warmup (float32)
        0.001
        >>> s = make_schedule(1e-3, schedule="cosine", total_steps=100)
        >>> [round(float(s(t)), 6) for t in (0, 50, 100)]
        [0.001, 0.0005, 0.0]
    """
    if schedule not in _SCHEDULES:
        raise ConfigError(f"Unknown schedule {schedule!r}; expected one of {_SCHEDULES}.")
    if schedule == "cosine":
        if total_steps <= warmup_steps:
            raise ConfigError(
                f"A cosine schedule needs total_steps > warmup_steps, got total_steps="
                f"{total_steps}, warmup_steps={warmup_steps}. Fix: set optim.total_steps "
                "(usually trainer.max_steps)."
            )
        if not warmup_steps:  # optax logs about a zero-step warmup (absl INFO) otherwise
            return optax.cosine_decay_schedule(lr, total_steps)
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps)
    if warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
            [warmup_steps],
        )
    return optax.constant_schedule(lr)


def make_optimizer(
    name: str = "adamw",
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    momentum: float = 0.9,
    clip_norm: float | None = None,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int = 0,
) -> optax.GradientTransformation:
    """An optax optimizer whose current learning rate is readable from its state.

    The learning rate is injected as a hyperparameter, so :func:`current_lr` can read it
    from ``opt_state`` for logging.

    Args:
        name: ``adamw``, ``adam``, ``sgd`` or ``lion``.
        lr: peak learning rate.
        weight_decay: decoupled weight decay (adamw, lion).
        b1: first-moment decay (adam, adamw, lion).
        b2: second-moment decay (adam, adamw, lion).
        momentum: sgd momentum.
        clip_norm: clip gradients to this global norm first, when set.
        schedule: ``constant`` or ``cosine``.
        warmup_steps: linear warmup steps.
        total_steps: steps of the whole run (cosine only).

    Returns:
        An ``optax.GradientTransformation``.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = make_optimizer("adamw", lr=1e-2)
        >>> round(float(current_lr(tx.init({"w": jnp.zeros(3)}))), 6)
        0.01
    """
    if name not in _OPTIMIZERS:
        raise ConfigError(
            f"Unknown optimizer {name!r}; expected one of {_OPTIMIZERS}. "
            "Fix: set optim.name to one of them."
        )
    sched = make_schedule(lr, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps)

    def build(learning_rate: float) -> optax.GradientTransformation:
        if name == "adamw":
            opt = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
        elif name == "adam":
            opt = optax.adam(learning_rate, b1=b1, b2=b2)
        elif name == "sgd":
            opt = optax.sgd(learning_rate, momentum=momentum or None)
        else:
            opt = optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
        if clip_norm:
            return optax.chain(optax.clip_by_global_norm(clip_norm), opt)
        return opt

    return optax.inject_hyperparams(build)(learning_rate=sched)


def current_lr(opt_state: optax.OptState) -> float:
    """The learning rate an optimizer from :func:`make_optimizer` uses at its next update."""
    return opt_state.hyperparams["learning_rate"]  # type: ignore[attr-defined,no-any-return]
