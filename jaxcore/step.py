"""The jitted train step over a mesh.

One train step, inside one ``jax.jit``: split the batch into ``accum_steps`` micro-batches and
``lax.scan`` over them summing masked losses and gradients (exact masked means over the whole
batch, whatever the split); clip and update with optax; guard against NaN/Inf; and, with
``steps_per_call=K``, ``lax.scan`` that whole step over K stacked batches so the loop and
dispatch cost is paid once per K steps. Steps that do not train: :mod:`jaxcore.eval_step`.

Randomness: the step's key is ``fold_in(state.rng, state.step)`` and micro-batch ``i`` uses
``fold_in(key, i)``. JAX's partitionable threefry (the default) lets each device draw its own
slice of the one global random stream: dropout masks are independent per device, deterministic
per seed and step, and the same on any mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcore._errors import BatchError
from jaxcore._sums import LossFn, Metrics, _drop_leading_axes, _flat_rows, _micro_batches, _sums
from jaxcore.compile import Step, check_positive
from jaxcore.guard import check_policy, finite_ok, guarded, input_where
from jaxcore.losses import MICRO, TOTAL
from jaxcore.model import Batch, ModelFns
from jaxcore.precision import resolve_dtype
from jaxcore.state import TrainState

PyTree = Any

__all__ = ["LossFn", "make_train_step"]


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
    """A jitted ``train_step(state, batch) -> (state, metrics)``.

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
    dtype = resolve_dtype(compute_dtype)
    dtype = None if dtype == jnp.float32 else dtype
    policy = check_policy(nan_policy)

    def sums_fn(params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array) -> Any:
        return _sums(model, loss_fn, params, model_state, batch, key, dtype, weigh_rows)

    value_and_grad = jax.value_and_grad(sums_fn, has_aux=True)

    def one_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return _step(state, batch, m)

    def flat_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return _step(state, batch, 1)  # the loop-free step whose cost is analysed

    def _step(state: TrainState, batch: Batch, m: int) -> tuple[TrainState, Metrics]:
        key = jax.random.fold_in(state.rng, state.step)
        micro_sums: Any = None  # per micro-batch: (sums, count) stacked on a leading axis
        if unrolled_micro:
            model_state, each = state.model_state, []
            acc: Any = None
            for i, mb in enumerate(batch):
                (l_sum, (model_state, sums, c)), g = value_and_grad(
                    state.params, model_state, mb, jax.random.fold_in(key, i)
                )
                new = (g, l_sum, sums, c)
                acc = new if acc is None else jax.tree.map(jnp.add, acc, new)
                each.append((sums, c))
            grads, loss_sum, sums, count = acc
            micro_sums = jax.tree.map(lambda *v: jnp.stack(v), *each)
        elif m == 1:
            if stacked_micro:  # (a window of one: micro-batch 0, as in a longer window)
                batch, key = jax.tree.map(lambda v: v[0], batch), jax.random.fold_in(key, 0)
            (loss_sum, (model_state, sums, count)), grads = value_and_grad(
                state.params, state.model_state, batch, key
            )
            if stacked_micro:
                micro_sums = jax.tree.map(lambda v: v[None], (sums, count))
        else:
            micro = batch if stacked_micro else _micro_batches(batch, m)

            def accumulate(carry: Any, xs: Any) -> tuple[Any, Any]:
                g_acc, l_acc, s_acc, c_acc, ms = carry
                i, mb = xs
                (l_sum, (ms, sums, c)), g = value_and_grad(
                    state.params, ms, mb, jax.random.fold_in(key, i)
                )
                add = jax.tree.map(jnp.add, (g_acc, l_acc, s_acc, c_acc), (g, l_sum, sums, c))
                return (*add, ms), ((sums, c) if per_micro else None)

            first_micro = jax.tree.map(lambda v: v[0], micro)
            _, (_, sums_shape, _) = jax.eval_shape(
                sums_fn, state.params, state.model_state, first_micro, key
            )
            zeros = (
                jax.tree.map(jnp.zeros_like, state.params),
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
                jnp.zeros((), jnp.float32),
                state.model_state,
            )
            (grads, loss_sum, sums, count, model_state), micro_sums = jax.lax.scan(
                accumulate, zeros, (jnp.arange(m), micro)
            )
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        if grad_scale != 1.0:
            grads = jax.tree.map(lambda g: g * grad_scale, grads)
        hook_metrics: Metrics = {}
        if grads_fn is not None:
            grads, hook_metrics = grads_fn(state, grads)
        loss = loss_sum / denom
        metrics = {
            "loss": loss,
            **{name: v if name.startswith(TOTAL) else v / denom for name, v in sums.items()},
            **hook_metrics,
        }
        if per_micro and micro_sums is not None:
            each_sums, each_count = micro_sums
            each_denom = jnp.maximum(each_count, 1.0)
            metrics |= {
                f"{MICRO}{name}": v / each_denom
                for name, v in each_sums.items()
                if not name.startswith(TOTAL)
            }

        def update() -> tuple[PyTree, PyTree, PyTree]:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state, model_state

        if policy == "none":
            params, opt_state, model_state = update()
            return dataclasses.replace(
                state,
                step=state.step + 1,
                params=params,
                opt_state=opt_state,
                model_state=model_state,
            ), metrics
        ok = finite_ok(loss, grads, state, policy)
        where = state.nonfinite_input
        if policy == "stop":  # a NaN/Inf input is refused and named (its field, its rows)
            found = input_where(_flat_rows(batch, stacked_micro, unrolled_micro))
            ok = ok & (found[0] < 0)
            where = jnp.where((state.nonfinite_step < 0) & ~ok, found, where)
        params, opt_state, model_state = guarded(
            ok, update, (state.params, state.opt_state, state.model_state)
        )
        bad = (~ok).astype(jnp.int32)
        first = jnp.where((state.nonfinite_step < 0) & ~ok, state.step, state.nonfinite_step)
        new_state = dataclasses.replace(
            state,
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            nonfinite=state.nonfinite + bad,
            nonfinite_step=first,
            nonfinite_input=where,
        )
        return new_state, {**metrics, "nonfinite": bad.astype(jnp.float32)}

    def multi_step(state: TrainState, batches: Batch) -> tuple[TrainState, Metrics]:
        leading = {
            jax.tree_util.keystr(path): v.shape[0] if v.ndim else None
            for path, v in jax.tree_util.tree_leaves_with_path(batches)
        }
        if any(n != k for n in leading.values()):
            raise BatchError(
                f"steps_per_call={k} needs every batch field stacked as [{k}, B, ...], got "
                f"leading sizes {leading}. Fix: stack {k} batches (e.g. np.stack) per call."
            )
        return jax.lax.scan(one_step, state, batches)

    return Step(
        one_step if k == 1 else multi_step,
        name="train_step",
        steps_per_call=k,
        # only a looping step needs the loop-free twin traced for its cost (a second trace
        # and lowering: a third of a warm start's time to the first step, measured)
        cost_fn=flat_step if (k > 1 or m > 1) and not unrolled_micro else None,
        cost_args=lambda st, b: (st, _drop_leading_axes(b, int(k > 1))),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,) if donate else (),
    )
