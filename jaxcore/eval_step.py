"""Jitted steps that do not train: the train step's forward alone, evaluation, prediction."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcore._sums import LossFn, Metrics, _forward, _inputs, _reduce, _weights
from jaxcore.compile import Step
from jaxcore.guard import checked_forward
from jaxcore.model import Batch, ModelFns
from jaxcore.precision import cast_floating, resolve_dtype
from jaxcore.state import TrainState

PyTree = Any

__all__ = ["make_eval_step", "make_predict_step", "make_train_forward"]


def make_train_forward(
    model: ModelFns,
    loss_fn: LossFn,
    *,
    micro: bool = False,
    compute_dtype: Any = None,
    weigh_rows: bool = True,
) -> Step:
    """A jitted ``forward(state, batch, i) -> (outputs, loss)``: the train step's forward alone.

    The model's training-mode outputs and the batch's mean loss exactly as the next
    :func:`jaxcore.make_train_step` call computes them: the same params (the state before the
    update), the same random key (``fold_in(state.rng, state.step)``, and for ``micro=True``
    micro-batch ``i``'s ``fold_in(key, i)``), so dropout masks agree. For the shell to report
    a micro-batch's own loss while its accumulation window is still open (Lightning's
    ``on_train_batch_end`` outputs), or what a traced step returns beside its loss. The
    state is not donated nor changed.

    Args:
        model: init/apply functions.
        loss_fn: ``(outputs, batch) -> (loss[B], metrics)``.
        micro: the batch is micro-batch ``i`` of a ``stacked_micro`` accumulation window;
            ``False``: a whole step's batch (``i`` is ignored).
        compute_dtype: as for :func:`jaxcore.make_train_step`.
        weigh_rows: as for :func:`jaxcore.make_train_step`.

    Returns:
        The jitted :class:`jaxcore.Step`.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32)}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> _, loss = make_train_forward(model, jaxcore.softmax_cross_entropy)(st, batch, 0)
        >>> step = jaxcore.make_train_step(model, jaxcore.softmax_cross_entropy, tx,
        ...     state_sharding=jaxcore.state_shardings(st))
        >>> _, metrics = step(st, batch)
        >>> bool(jnp.allclose(loss, metrics["loss"]))
        True
    """
    dtype = resolve_dtype(compute_dtype)
    dtype = None if dtype == jnp.float32 else dtype

    def forward(state: TrainState, batch: Batch, i: jax.Array) -> tuple[Any, jax.Array]:
        key = jax.random.fold_in(state.rng, state.step)
        if micro:
            key = jax.random.fold_in(key, i)
        outputs, _ = _forward(model, state.params, state.model_state, batch, key, dtype)
        losses, _ = loss_fn(outputs, batch)
        mask, count = _weights(batch, weigh_rows)
        return outputs, _reduce(losses, mask, count) / jnp.maximum(count, 1.0)

    return Step(forward, name="train_forward")


def make_eval_step(
    model: ModelFns,
    loss_fn: LossFn,
    *,
    batch_sharding: PyTree = None,
    state_sharding: PyTree = None,
    compute_dtype: Any = None,
    input_checks: bool = False,
    weigh_rows: bool = True,
) -> Step:
    """A jitted ``eval_step(state, batch) -> sums`` for exact epoch means.

    ``weigh_rows=False``: each batch weighs one (its loss and metrics are batch means; a
    batch whose fields have no common rows, a graph), as in :func:`jaxcore.make_train_step`.

    Returns sums over the valid rows and their ``count``; divide the accumulated sums by the
    accumulated count for means that padded rows never touch. With ``input_checks`` it
    returns ``(sums, check)``: the model's input checks (embedding indices), for
    :func:`jaxcore.guard.raise_failed` at the epoch's end.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32),
        ...          "mask": jnp.arange(8) < 6}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> float(make_eval_step(model, jaxcore.softmax_cross_entropy)(st, batch)["count"])
        6.0
    """
    dtype = resolve_dtype(compute_dtype)
    dtype = None if dtype == jnp.float32 else dtype

    def step(state: TrainState, batch: Batch) -> Metrics:
        outputs, _ = model.apply(
            cast_floating(state.params, dtype),
            state.model_state,
            _inputs(batch, dtype),
            state.rng,
            False,
        )
        losses, metrics = loss_fn(cast_floating(outputs, jnp.float32), batch)
        mask, count = _weights(batch, weigh_rows)
        sums = {k: _reduce(v, mask, count, k) for k, v in metrics.items()}
        return {"loss": _reduce(losses, mask, count), **sums, "count": count}

    fn = checked_forward(step) if input_checks else step
    return Step(fn, name="eval_step", in_shardings=(state_sharding, batch_sharding))


def make_predict_step(
    model: ModelFns, *, compute_dtype: Any = None, input_checks: bool = False
) -> Step:
    """A jitted ``predict_step(state, batch) -> outputs`` in eval mode (``(outputs, check)``
    with ``input_checks``, as :func:`make_eval_step`).

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> st = jaxcore.init_train_state(model, tx, {"x": jnp.ones((8, 64))}, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> make_predict_step(model)(st, {"x": jnp.ones((8, 64))}).shape
        (8, 10)
    """
    dtype = resolve_dtype(compute_dtype)
    dtype = None if dtype == jnp.float32 else dtype

    def step(state: TrainState, batch: Batch) -> PyTree:
        outputs = model.apply(
            cast_floating(state.params, dtype),
            state.model_state,
            _inputs(batch, dtype),
            state.rng,
            False,
        )[0]
        return cast_floating(outputs, jnp.float32)

    return Step(checked_forward(step) if input_checks else step, name="predict_step")
