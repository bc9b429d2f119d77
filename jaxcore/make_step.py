"""``make_train_step``: the train step's transforms chained from keyword options, and jitted.

The convenience of the docs and of users' scripts; the shell chains the transforms itself
(:mod:`jaxcore.step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxcore._sums import LossFn, Metrics
from jaxcore.compile import Step, check_positive
from jaxcore.grads import accumulate, row_grads, unrolled
from jaxcore.model import ModelFns
from jaxcore.state import TrainState
from jaxcore.step import jit_step, k_steps, scale_grads, train_step

PyTree = Any

__all__ = ["make_train_step"]


def make_train_step(
    model: ModelFns,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    state_sharding: PyTree = None,
    batch_sharding: PyTree = None,
    donate: bool = True,
    steps_per_call: int = 1,
    accum_steps: int = 1,
    compute_dtype: Any = None,
    nan_policy: str = "none",
    stacked_micro: bool = False,
    grad_scale: float = 1.0,
    weigh_rows: bool = True,
    unrolled_micro: bool = False,
    per_micro: bool = False,
    grads_fn: Callable[[TrainState, PyTree], tuple[PyTree, Metrics]] | None = None,
) -> Step:
    """A jitted ``train_step(state, batch) -> (state, metrics)``: the transforms composed.

    A convenience over the chain of :mod:`jaxcore.step` (what the shell builds itself): the
    options pick the transforms, ``accum_steps``/``stacked_micro``/``unrolled_micro`` the
    gradient function (:mod:`jaxcore.grads`), ``grad_scale``/``grads_fn`` the hooks and
    ``nan_policy`` the guard of :func:`~jaxcore.train_step`, ``steps_per_call``
    :func:`~jaxcore.k_steps`, the shardings and ``donate`` :func:`~jaxcore.jit_step`.

    Losses and metrics are exact masked means over the batch ``mask`` (all rows when absent),
    also across micro-batches. The state is donated, so the caller must use the returned one.
    Gradient clipping and the learning-rate schedule live in ``tx``
    (:func:`jaxcore.make_optimizer`).

    Args:
        model: init/apply functions.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``.
        tx: the optimizer.
        state_sharding: shardings of the state (``state_shardings(state)``).
        batch_sharding: shardings of the batch (``jaxcore.batch_sharding(mesh, ...)``), or
            ``None`` to take the arrays' own.
        donate: donate the input state's buffers.
        steps_per_call: K > 1 takes K stacked batches (every field ``[K, B, ...]``), runs K
            optimizer steps in one ``lax.scan`` and returns metrics with a leading K axis.
        accum_steps: micro-batches per step; gradients are summed over them in a
            ``lax.scan`` (same update as one step on the full batch, less activation memory).
        compute_dtype: ``None``/``"float32"`` or ``"bfloat16"``: the dtype of the forward and
            backward pass; params, gradients, optimizer state and the loss stay float32.
        nan_policy: ``"none"``, ``"skip"`` or ``"stop"`` (see :mod:`jaxcore.guard`); with a
            guard the metrics gain ``nonfinite`` (1.0 on a refused step).
        stacked_micro: with ``accum_steps=m``, the batch already holds its m micro-batches
            on a leading axis (``[m, B, ...]``, e.g. m DataLoader batches stacked for
            Lightning's ``accumulate_grad_batches``) instead of being split by rows.

        grad_scale: multiplies the mean gradient before the update (Lightning's last,
            short accumulation window: ``k / accumulate_grad_batches``).
        weigh_rows: ``True``: means over rows (a micro-batch weighs its valid rows).
            ``False``: each micro-batch weighs one, as under Lightning's
            ``accumulate_grad_batches`` (the mean of the micro-batches' means); the loss and
            metrics must be 0-d batch means and the fields need no common row count.
        unrolled_micro: the batch is a sequence of micro-batches whose shapes may differ
            (an accumulation window holding a ragged last batch), unrolled in the step
            instead of scanned; micro-batch ``i`` draws ``fold_in(key, i)`` as when stacked.
        per_micro: with ``stacked_micro``/``unrolled_micro``, the metrics also hold each
            micro-batch's own values, ``MICRO + name`` of shape ``[m]`` (the loss's
            excluded: it is the step's).
        grads_fn: ``(state, grads) -> (grads, metrics)``, run on the step's gradients
            (the mean over its micro-batches, after ``grad_scale``) before the optimizer
            sees them (clipping lives in ``tx``, after it): it may change them and report
            metrics, merged into the step's (a Lightning module's
            ``on_before_optimizer_step``). ``state`` is the state before the update.

    The batch is any pytree of ``[B, ...]`` arrays (a dict, a tuple, nested); an optional
    ``mask`` key of a dict batch marks the real rows. A loss or metric the ``loss_fn``
    returns as a 0-d array is a mean over the (unpadded) batch.

    Returns:
        The jitted step, a :class:`jaxcore.Step` (``.compile(state, batch)`` for statistics).

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32)}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> step = make_train_step(model, jaxcore.softmax_cross_entropy, tx,
        ...     state_sharding=jaxcore.state_shardings(st), accum_steps=2)
        >>> st, metrics = step(st, batch)
        >>> int(st.step), sorted(metrics)
        (1, ['accuracy', 'loss'])
    """
    k = check_positive("steps_per_call", steps_per_call)
    m = check_positive("accum_steps", accum_steps)
    grad_fn = row_grads(model, loss_fn, compute_dtype=compute_dtype, weigh_rows=weigh_rows)
    if unrolled_micro:
        grad_fn = unrolled(grad_fn, per_micro=per_micro)
    else:
        grad_fn = accumulate(grad_fn, m, stacked=stacked_micro, per_micro=per_micro)
    hooks = [scale_grads(grad_scale)] if grad_scale != 1.0 else []
    hooks += [grads_fn] if grads_fn is not None else []
    step = train_step(grad_fn, tx, hooks=hooks, nan_policy=nan_policy)
    return jit_step(
        k_steps(step, k) if k > 1 else step,
        state_sharding=state_sharding,
        batch_sharding=batch_sharding,
        donate=donate,
    )
