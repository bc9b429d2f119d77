"""The jitted train step over a mesh, composed from small transforms.

A step is a gradient function (:mod:`jaxcore.grads`: :func:`~jaxcore.grads.row_grads`, wrapped
by :func:`~jaxcore.grads.accumulate` for micro-batches) turned into an update by
:func:`train_step`: the exact masked means (one division by the valid rows), the gradient
hooks in order (:func:`scale_grads`, a module's own), the optax update and, with a NaN policy,
the guard (:mod:`jaxcore.guard`). :func:`k_steps` runs any step K times over K stacked batches
in one ``lax.scan``, so the loop and dispatch cost is paid once per K steps.
:func:`make_train_step` composes them from its options and jits the result. Steps that do not
train: :mod:`jaxcore.eval_step`.

Randomness: the step's key is ``fold_in(state.rng, state.step)`` and micro-batch ``i`` uses
``fold_in(key, i)``. JAX's partitionable threefry (the default) lets each device draw its own
slice of the one global random stream: dropout masks are independent per device, deterministic
per seed and step, and the same on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import optax

from jaxcore._errors import BatchError
from jaxcore._inputs import input_where, window_input_where
from jaxcore._sums import LossFn, Metrics, _drop_leading_axes, _flat_rows
from jaxcore.compile import Step, check_positive
from jaxcore.grads import GradFn, Grads, accumulate, row_grads, unrolled
from jaxcore.guard import CHECKED, check_policy, checked, finite_ok, guarded
from jaxcore.losses import MICRO, TOTAL
from jaxcore.model import Batch, ModelFns
from jaxcore.state import TrainState

PyTree = Any

__all__ = [
    "GradsHook",
    "LossFn",
    "StepFn",
    "k_steps",
    "make_train_step",
    "scale_grads",
    "train_step",
]

StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
GradsHook = Callable[[TrainState, PyTree], tuple[PyTree, Metrics]]


class CheckedStepFn(Protocol):
    """A :data:`StepFn` that also takes its batch's input check ``found`` (``int32[...]``,
    computed before the loop by :func:`k_steps`), or ``None`` to check the batch itself."""

    def __call__(
        self, state: TrainState, batch: Batch, found: jax.Array | None = None, /
    ) -> tuple[TrainState, Metrics]: ...


def scale_grads(factor: float) -> GradsHook:
    """A gradient hook multiplying the mean gradient by ``factor`` (Lightning's last, short
    accumulation window: ``k / accumulate_grad_batches``).

    Example:
        >>> import jax.numpy as jnp
        >>> grads, metrics = scale_grads(0.5)(None, {"w": jnp.ones(2)})
        >>> grads["w"].tolist(), metrics
        ([0.5, 0.5], {})
    """

    def hook(state: TrainState, grads: PyTree) -> tuple[PyTree, Metrics]:
        return jax.tree.map(lambda g: g * factor, grads), {}

    return hook


def _means(g: Grads) -> tuple[PyTree, Metrics]:
    """The mean gradient and the step's metrics: masked sums over the valid-row count."""
    denom = jnp.maximum(g.count, 1.0)
    metrics = {
        "loss": g.loss / denom,
        **{name: v if name.startswith(TOTAL) else v / denom for name, v in g.sums.items()},
    }
    if g.each is not None:  # each micro-batch's own values, ``MICRO + name`` of shape [m]
        each_sums, each_count = g.each
        each_denom = jnp.maximum(each_count, 1.0)
        metrics |= {
            f"{MICRO}{name}": v / each_denom
            for name, v in each_sums.items()
            if not name.startswith(TOTAL)
        }
    return jax.tree.map(lambda v: v / denom, g.grads), metrics


def _guarded_update(
    state: TrainState,
    update: Callable[[], tuple[PyTree, PyTree, PyTree]],
    ok: jax.Array,
    found: jax.Array | None,
) -> TrainState:
    """The state after ``update()`` where ``ok``, else the old one; counts a refused step,
    remembers the first one and, when ``found`` (:func:`jaxcore.guard.input_where`,
    :func:`jaxcore.guard.checked`), where its input held NaN/Inf or failed a check."""
    where = state.nonfinite_input
    if found is not None:
        # a failed input check refuses the step (torch raises there); NaN/Inf in an input
        # only names the cause of a step refused for its loss or gradients: a model that
        # reads NaN as "missing" (torch.where, nan_to_num) trains as in torch
        ok = ok & (found[0] != CHECKED)
        where = jnp.where((state.nonfinite_step < 0) & ~ok, found, where)
    params, opt_state, model_state = guarded(
        ok, update, (state.params, state.opt_state, state.model_state)
    )
    first = jnp.where((state.nonfinite_step < 0) & ~ok, state.step, state.nonfinite_step)
    return dataclasses.replace(
        state,
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        model_state=model_state,
        nonfinite=state.nonfinite + (~ok).astype(jnp.int32),
        nonfinite_step=first,
        nonfinite_input=where,
    )


def train_step(
    grad_fn: GradFn,
    tx: optax.GradientTransformation,
    *,
    hooks: Sequence[GradsHook] = (),
    nan_policy: str = "none",
    input_rows: Callable[[Batch], Batch] = lambda batch: batch,
) -> CheckedStepFn:
    """One optimizer step from a gradient function: ``step(state, batch) -> (state, metrics)``.

    The step's key is ``fold_in(state.rng, state.step)``; losses, metrics and gradients are
    exact masked means (the sums of ``grad_fn`` over its valid-row count); ``hooks`` run in
    order on the mean gradient before ``tx`` sees it (clipping lives in ``tx``, after them),
    each may change it and report metrics. Not jitted: :func:`make_train_step` jits it.

    Args:
        grad_fn: the step's gradient function (:mod:`jaxcore.grads`).
        tx: the optimizer.
        hooks: ``(state, grads) -> (grads, metrics)``; ``state`` is the one before the update.
        nan_policy: ``"none"``, ``"skip"`` or ``"stop"`` (:mod:`jaxcore.guard`); with a guard
            the metrics gain ``nonfinite`` (1.0 on a refused step).
        input_rows: the batch as one batch of rows (under ``"stop"`` a batch field holding
            NaN/Inf refuses the step, its rows numbered this way). With a guard, a failed
            input check of the forward pass (:func:`jaxcore.guard.input_check`, e.g. an
            embedding's index range) refuses the step too.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32)}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> step = train_step(row_grads(model, jaxcore.softmax_cross_entropy), tx)
        >>> st, metrics = step(st, batch)
        >>> int(st.step), sorted(metrics)
        (1, ['accuracy', 'loss'])
    """
    policy = check_policy(nan_policy)

    def step(
        state: TrainState, batch: Batch, found: jax.Array | None = None
    ) -> tuple[TrainState, Metrics]:
        key = jax.random.fold_in(state.rng, state.step)
        g = grad_fn(state.params, state.model_state, batch, key)
        grads, metrics = _means(g)
        for hook in hooks:
            grads, hook_metrics = hook(state, grads)
            metrics = {**metrics, **hook_metrics}

        def update() -> tuple[PyTree, PyTree, PyTree]:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state, g.model_state

        if policy == "none":
            params, opt_state, model_state = update()
            new = dataclasses.replace(
                state,
                step=state.step + 1,
                params=params,
                opt_state=opt_state,
                model_state=model_state,
            )
            return new, metrics
        ok = finite_ok(metrics["loss"], grads, state, policy)
        if policy == "stop" and found is None:  # (k_steps hands it in, found per window)
            found = input_where(input_rows(batch))
        if g.check is not None:  # an input check (embedding index range) failed: refused
            failed = checked(g.check)
            found = failed if found is None else jnp.where(failed[0] == CHECKED, failed, found)
        new = _guarded_update(state, update, ok, found)
        refused = (new.nonfinite - state.nonfinite).astype(jnp.float32)
        return new, {**metrics, "nonfinite": refused}

    return step


def k_steps(
    step: StepFn | CheckedStepFn,
    k: int,
    *,
    input_check: Callable[[Batch], jax.Array] | None = None,
) -> StepFn:
    """``step`` run over K stacked batches (every field ``[K, B, ...]``) in one ``lax.scan``;
    the metrics gain a leading K axis.

    ``input_check`` (``nan_policy="stop"``: :func:`jaxcore.guard.window_input_where`) checks
    the K batches' inputs at once, before the loop; ``step`` then takes each batch's result
    as a third argument instead of checking inside the loop.

    Example:
        >>> import jax.numpy as jnp
        >>> def count(state, batch):
        ...     return state + 1, {"x": batch["x"].sum()}
        >>> state, metrics = k_steps(count, 3)(0, {"x": jnp.ones((3, 2))})
        >>> int(state), metrics["x"].tolist()
        (3, [2.0, 2.0, 2.0])
    """

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
        if input_check is None:
            return jax.lax.scan(step, state, batches)
        found = input_check(batches)
        with_found = cast(CheckedStepFn, step)  # (with input_check: a CheckedStepFn, above)
        return jax.lax.scan(lambda st, xs: with_found(st, *xs), state, (batches, found))

    return multi_step


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

    The options pick the transforms: ``accum_steps``/``stacked_micro``/``unrolled_micro``
    the gradient function (:mod:`jaxcore.grads`), ``grad_scale``/``grads_fn`` the hooks and
    ``nan_policy`` the guard of :func:`train_step`, ``steps_per_call`` :func:`k_steps`.

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
    base = row_grads(model, loss_fn, compute_dtype=compute_dtype, weigh_rows=weigh_rows)
    if unrolled_micro:
        grad_fn = unrolled(base, per_micro=per_micro)
    else:
        grad_fn = accumulate(base, m, stacked=stacked_micro, per_micro=per_micro)
    hooks = ([scale_grads(grad_scale)] if grad_scale != 1.0 else []) + (
        [grads_fn] if grads_fn is not None else []
    )

    def input_rows(batch: Batch) -> Batch:
        return _flat_rows(batch, stacked_micro, unrolled_micro)

    def compose(grad_fn: GradFn) -> CheckedStepFn:
        return train_step(grad_fn, tx, hooks=hooks, nan_policy=nan_policy, input_rows=input_rows)

    one_step = compose(grad_fn)
    window_check = None
    if k > 1 and check_policy(nan_policy) == "stop":  # the window's inputs checked at once
        window_check = functools.partial(window_input_where, k=k, rows=input_rows)
    # only a looping step needs the loop-free twin traced for its cost (a second trace and
    # lowering: a third of a warm start's time to the first step, measured)
    looping = (k > 1 or m > 1) and not unrolled_micro
    flat = compose(accumulate(base, 1, stacked=stacked_micro)) if looping else None
    return Step(
        one_step if k == 1 else k_steps(one_step, k, input_check=window_check),
        name="train_step",
        steps_per_call=k,
        cost_fn=flat,
        cost_args=lambda st, b: (st, _drop_leading_axes(b, int(k > 1))),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,) if donate else (),
    )
