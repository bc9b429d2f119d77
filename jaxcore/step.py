"""Jitted train, eval and predict steps over a mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcore.losses import masked_mean
from jaxcore.model import Batch, ModelFns
from jaxcore.state import TrainState

PyTree = Any
LossFn = Callable[[PyTree, Batch], tuple[jax.Array, dict[str, jax.Array]]]
Metrics = dict[str, jax.Array]


def _mask(batch: Batch, n: int) -> jax.Array:
    mask = batch.get("mask")
    return jnp.ones((n,), bool) if mask is None else mask


def make_train_step(
    model: ModelFns,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    state_sharding: PyTree = None,
    batch_sharding: PyTree = None,
    donate: bool = True,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """A jitted ``train_step(state, batch) -> (state, metrics)``.

    Losses and metrics are masked means over the batch ``mask`` (all rows when absent).
    Dropout keys are ``fold_in(state.rng, state.step)``: deterministic per seed and step.
    The state is donated, so the caller must use the returned state.

    Args:
        model: init/apply functions.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``.
        tx: the optimizer.
        state_sharding: shardings of the state (``state_shardings(state)``).
        batch_sharding: shardings of the batch, or ``None`` to take the arrays' own.
        donate: donate the input state's buffers.

    Returns:
        The jitted step.
    """

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        key = jax.random.fold_in(state.rng, state.step)

        def objective(params: PyTree) -> tuple[jax.Array, tuple[PyTree, Metrics]]:
            outputs, model_state = model.apply(params, state.model_state, batch, key, True)
            losses, metrics = loss_fn(outputs, batch)
            mask = _mask(batch, losses.shape[0])
            means = {k: masked_mean(v, mask) for k, v in metrics.items()}
            return masked_mean(losses, mask), (model_state, means)

        (loss, (model_state, metrics)), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state
        )
        return new_state, {"loss": loss, **metrics}

    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,) if donate else (),
    )


def make_eval_step(
    model: ModelFns, loss_fn: LossFn, *, batch_sharding: PyTree = None
) -> Callable[[TrainState, Batch], Metrics]:
    """A jitted ``eval_step(state, batch) -> sums`` for exact epoch means.

    Returns sums over the valid rows and their ``count``; divide the accumulated sums by the
    accumulated count for means that padded rows never touch.
    """

    def step(state: TrainState, batch: Batch) -> Metrics:
        outputs, _ = model.apply(state.params, state.model_state, batch, state.rng, False)
        losses, metrics = loss_fn(outputs, batch)
        mask = _mask(batch, losses.shape[0]).astype(jnp.float32)
        sums = {k: jnp.sum(v * mask) for k, v in metrics.items()}
        return {"loss": jnp.sum(losses * mask), **sums, "count": jnp.sum(mask)}

    return jax.jit(step, in_shardings=(None, batch_sharding))


def make_predict_step(model: ModelFns) -> Callable[[TrainState, Batch], PyTree]:
    """A jitted ``predict_step(state, batch) -> outputs`` in eval mode."""

    def step(state: TrainState, batch: Batch) -> PyTree:
        return model.apply(state.params, state.model_state, batch, state.rng, False)[0]

    return jax.jit(step)
