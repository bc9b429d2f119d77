"""The jitted train step over a mesh, composed from small transforms.

A step is a gradient function (:mod:`jaxcore.grads`: :func:`~jaxcore.grads.row_grads`, wrapped
by :func:`~jaxcore.grads.accumulate` for micro-batches) turned into an update by
:func:`train_step`: the exact masked means (one division by the valid rows), the gradient
hooks in order (:func:`scale_grads`, a module's own), the optax update and, with a NaN policy,
the guard (:mod:`jaxcore.guard`). :func:`k_steps` runs any step K times over K stacked batches
in one ``lax.scan``, so the loop and dispatch cost is paid once per K steps. :func:`jit_step`
jits the result with the state's shardings and donation. Each behaviour is the presence of a
transform, chained at the call site as optax chains gradient transformations::

    grad_fn = accumulate(row_grads(model, loss_fn), 4)          # 4 micro-batches
    step = train_step(grad_fn, tx, hooks=[scale_grads(0.5)], nan_policy="skip")
    step = jit_step(k_steps(step, 8), state_sharding=state_shardings(state))

(:func:`jaxcore.make_train_step` is the same chain from keyword options.) Steps that do not
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
from jaxcore._sums import LossFn, Metrics, _drop_leading_axes
from jaxcore.compile import Step
from jaxcore.grads import GradFn, Grads, Window
from jaxcore.guard import CHECKED, check_policy, checked, finite_ok, guarded
from jaxcore.losses import MICRO, TOTAL
from jaxcore.model import Batch
from jaxcore.state import TrainState

PyTree = Any

__all__ = [
    "ComposedStep",
    "GradsHook",
    "LossFn",
    "StepFn",
    "jit_step",
    "k_steps",
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


@dataclasses.dataclass(frozen=True)
class ComposedStep:
    """A step a transform gave (:func:`train_step`, :func:`k_steps`): called like ``fn``, it
    also carries what :func:`k_steps` and :func:`jit_step` need to know of it.

    Attributes:
        fn: the step, ``(state, batch[, found]) -> (state, metrics)``.
        steps_per_call: optimizer steps per call.
        input_rows: with ``nan_policy="stop"``, the batch as one batch of rows (the inputs
            :func:`k_steps` checks for a whole window at once), else ``None``.
        loop_free: when ``fn`` loops (micro-batches, K steps), one optimizer step of the same
            computation without loops, for XLA's cost analysis; else ``None``.
    """

    fn: Callable[..., tuple[TrainState, Metrics]]
    steps_per_call: int = 1
    input_rows: Callable[[Batch], Batch] | None = None
    loop_free: StepFn | None = None

    def __call__(self, *args: Any) -> tuple[TrainState, Metrics]:
        return self.fn(*args)


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
    input_rows: Callable[[Batch], Batch] | None = None,
) -> ComposedStep:
    """One optimizer step from a gradient function: ``step(state, batch) -> (state, metrics)``.

    The step's key is ``fold_in(state.rng, state.step)``; losses, metrics and gradients are
    exact masked means (the sums of ``grad_fn`` over its valid-row count); ``hooks`` run in
    order on the mean gradient before ``tx`` sees it (clipping lives in ``tx``, after them),
    each may change it and report metrics. Not jitted: :func:`jit_step` jits it.

    Args:
        grad_fn: the step's gradient function (:mod:`jaxcore.grads`).
        tx: the optimizer.
        hooks: ``(state, grads) -> (grads, metrics)``; ``state`` is the one before the update.
        nan_policy: ``"none"``, ``"skip"`` or ``"stop"`` (:mod:`jaxcore.guard`); with a guard
            the metrics gain ``nonfinite`` (1.0 on a refused step).
        input_rows: the batch as one batch of rows (under ``"stop"`` a batch field holding
            NaN/Inf refuses the step, its rows numbered this way); ``None``: as ``grad_fn``
            reads its batch (a :class:`~jaxcore.grads.Window`'s micro-batches joined). With
            a guard, a failed input check of the forward pass
            (:func:`jaxcore.guard.input_check`, e.g. an embedding's index range) refuses the
            step too.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32)}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> step = train_step(jaxcore.row_grads(model, jaxcore.softmax_cross_entropy), tx)
        >>> st, metrics = step(st, batch)
        >>> int(st.step), sorted(metrics)
        (1, ['accuracy', 'loss'])
    """
    policy = check_policy(nan_policy)
    window = grad_fn if isinstance(grad_fn, Window) else None
    as_rows = input_rows or (window.joined if window is not None else _as_is)

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
            found = input_where(as_rows(batch))
        if g.check is not None:  # an input check (embedding index range) failed: refused
            failed = checked(g.check)
            found = failed if found is None else jnp.where(failed[0] == CHECKED, failed, found)
        new = _guarded_update(state, update, ok, found)
        refused = (new.nonfinite - state.nonfinite).astype(jnp.float32)
        return new, {**metrics, "nonfinite": refused}

    loop_free = None
    if window is not None and window.loop_free is not None:
        loop_free = train_step(window.loop_free, tx, hooks=hooks, nan_policy=nan_policy)
    return ComposedStep(step, input_rows=as_rows if policy == "stop" else None, loop_free=loop_free)


def _as_is(batch: Batch) -> Batch:
    """A batch that is already one batch of rows."""
    return batch


def k_steps(
    step: StepFn | CheckedStepFn,
    k: int,
    *,
    input_check: Callable[[Batch], jax.Array] | None = None,
) -> ComposedStep:
    """``step`` run over K stacked batches (every field ``[K, B, ...]``) in one ``lax.scan``;
    the metrics gain a leading K axis.

    ``input_check`` (``nan_policy="stop"``: :func:`jaxcore.guard.window_input_where`) checks
    the K batches' inputs at once, before the loop; ``step`` then takes each batch's result
    as a third argument instead of checking inside the loop. A :func:`train_step` under
    ``"stop"`` gets that check without asking.

    Example:
        >>> import jax.numpy as jnp
        >>> def count(state, batch):
        ...     return state + 1, {"x": batch["x"].sum()}
        >>> state, metrics = k_steps(count, 3)(0, {"x": jnp.ones((3, 2))})
        >>> int(state), metrics["x"].tolist()
        (3, [2.0, 2.0, 2.0])
    """

    composed = step if isinstance(step, ComposedStep) else None
    if input_check is None and composed is not None and composed.input_rows is not None:
        input_check = functools.partial(window_input_where, k=k, rows=composed.input_rows)

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

    inner = composed.steps_per_call if composed is not None else 1
    loop_free = (composed.loop_free if composed is not None else None) or step
    return ComposedStep(multi_step, steps_per_call=k * inner, loop_free=loop_free)


def jit_step(
    step: StepFn | ComposedStep,
    *,
    state_sharding: PyTree = None,
    batch_sharding: PyTree = None,
    donate: bool = True,
    name: str = "train_step",
) -> Step:
    """``step`` jitted: the state in and out on ``state_sharding``, its buffers donated.

    Args:
        step: the composed step (:func:`train_step`, :func:`k_steps`) or any
            ``(state, batch) -> (state, metrics)``.
        state_sharding: shardings of the state (``state_shardings(state)``).
        batch_sharding: shardings of the batch (``jaxcore.batch_sharding(mesh, ...)``), or
            ``None`` to take the arrays' own.
        donate: donate the input state's buffers (the caller must use the returned state).
        name: the name of the dumps (:meth:`jaxcore.Step.compile`).

    Returns:
        The jitted step, a :class:`jaxcore.Step` (``.compile(state, batch)`` for statistics;
        the FLOPs of one optimizer step, from the composed step's loop-free twin).

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model, tx = jaxcore.linen_model(MLP(features=(8,))), jaxcore.make_optimizer()
        >>> batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros(8, jnp.int32)}
        >>> st = jaxcore.init_train_state(model, tx, batch, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> grad_fn = jaxcore.accumulate(jaxcore.row_grads(model, jaxcore.softmax_cross_entropy), 2)
        >>> step = jit_step(train_step(grad_fn, tx), state_sharding=jaxcore.state_shardings(st))
        >>> st, metrics = step(st, batch)
        >>> int(st.step), step.steps_per_call
        (1, 1)
    """
    composed = step if isinstance(step, ComposedStep) else None
    k = composed.steps_per_call if composed is not None else 1
    return Step(
        step,
        name=name,
        steps_per_call=k,
        cost_fn=composed.loop_free if composed is not None else None,
        cost_args=lambda st, b: (st, _drop_leading_axes(b, int(k > 1))),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,) if donate else (),
    )
