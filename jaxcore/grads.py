"""Gradient functions of a train step, and the transforms that compose them.

A :data:`GradFn` maps ``(params, model_state, batch, key)`` to :class:`Grads`: the loss,
metric and gradient *sums* over the valid rows it saw and their count (exact masked means are
taken once, by the step: :mod:`jaxcore.step`). :func:`row_grads` is the base, one forward and
backward pass; :func:`accumulate` and :func:`unrolled` are function transforms over any
:data:`GradFn` (gradient accumulation as in Levanter: a wrapper, not a mode of the step).

Randomness: micro-batch ``i`` of an accumulated step draws ``fold_in(key, i)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcore._sums import LossFn, Metrics, _joined_stacked, _joined_unrolled, _micro_batches, _sums
from jaxcore.guard import NO_CHECK, checking, first_failed
from jaxcore.model import Batch, ModelFns
from jaxcore.precision import resolve_dtype

PyTree = Any

__all__ = ["GradFn", "Grads", "Window", "accumulate", "row_grads", "unrolled"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Grads:
    """What a :data:`GradFn` gives: sums over the rows it saw, and the new model state.

    A pytree (every field a child), immutable; :meth:`_replace` gives a changed copy. (A
    frozen dataclass, not a ``NamedTuple``: its ``count`` field would shadow
    ``tuple.count``.)

    Attributes:
        grads: the gradient of ``loss`` (a sum over rows) w.r.t. the params.
        loss: the masked sum of the per-row losses.
        sums: the masked sums of the metrics (``TOTAL`` ones as they are).
        count: the valid rows (``1`` per micro-batch when rows are not weighed).
        model_state: the model state after the forward passes (e.g. batch statistics).
        each: per micro-batch ``(sums, count)`` on a leading axis, or ``None``.
        check: ``int32[2]``, the first failed input check's ``[code, value]`` over the
            micro-batches (:func:`jaxcore.guard.input_check`; ``NO_CHECK``), or ``None``.
    """

    grads: PyTree
    loss: jax.Array
    sums: Metrics
    count: jax.Array
    model_state: PyTree
    each: Any = None
    check: Any = None

    def _replace(self, **changes: Any) -> Grads:
        """A copy with ``changes`` (as ``NamedTuple._replace``)."""
        return dataclasses.replace(self, **changes)


GradFn = Callable[[PyTree, PyTree, PyTree, jax.Array], Grads]
"""``(params, model_state, batch, key) -> Grads``; the batch is one batch, or the window of
micro-batches a transform takes (stacked ``[m, B, ...]``, or a sequence for :func:`unrolled`)."""


@dataclasses.dataclass(frozen=True)
class Window:
    """A :data:`GradFn` over a window of micro-batches (what :func:`accumulate` and
    :func:`unrolled` give): called like ``fn``, it also tells the step how to read its batch.

    Attributes:
        fn: the gradient function of the whole window.
        joined: the window's batch as one batch of rows (the NaN guard numbers a bad row
            within the window: :func:`jaxcore.train_step`).
        loop_free: when ``fn`` loops over its micro-batches, the same computation for one
            micro-batch without the loop (XLA's cost analysis counts a loop body once), else
            ``None``.
    """

    fn: GradFn
    joined: Callable[[Batch], Batch]
    loop_free: GradFn | None = None

    def __call__(self, params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array) -> Grads:
        return self.fn(params, model_state, batch, key)


def row_grads(
    model: ModelFns, loss_fn: LossFn, *, compute_dtype: Any = None, weigh_rows: bool = True
) -> GradFn:
    """The base gradient function: one forward and backward pass over a batch.

    Args:
        model: init/apply functions.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``.
        compute_dtype: ``None``/``"float32"`` or ``"bfloat16"`` for the passes (params,
            gradients and sums stay float32).
        weigh_rows: ``False``: the batch weighs one whatever its rows (0-d batch means).

    Example:
        >>> import jax, jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model = jaxcore.linen_model(MLP(features=(8,)))
        >>> batch = {"x": jnp.ones((4, 64)), "y": jnp.zeros(4, jnp.int32)}
        >>> params, ms = model.init(jax.random.key(0), batch)
        >>> grad_fn = row_grads(model, jaxcore.softmax_cross_entropy)
        >>> g = grad_fn(params, ms, batch, jax.random.key(1))
        >>> float(g.count), sorted(g.sums)
        (4.0, ['accuracy'])
    """
    dtype = resolve_dtype(compute_dtype)
    dtype = None if dtype == jnp.float32 else dtype

    def sums_fn(params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array) -> Any:
        with checking(batch) as checks:  # (an embedding's index range, reported in the pass)
            loss, aux = _sums(model, loss_fn, params, model_state, batch, key, dtype, weigh_rows)
            return loss, (*aux, checks.result())

    value_and_grad = jax.value_and_grad(sums_fn, has_aux=True)

    def grad_fn(params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array) -> Grads:
        (loss, (new_state, sums, count, check)), grads = value_and_grad(
            params, model_state, batch, key
        )
        return Grads(grads, loss, sums, count, new_state, check=check)

    return grad_fn


def _first_check(a: Any, b: Any) -> Any:
    """The earlier micro-batch's failed input check, else the later one's."""
    if a is None or b is None:
        return b if a is None else a
    return first_failed(a, b)


def _add(a: Grads, b: Grads) -> Grads:
    """Sums of two micro-batches; the model state is the later one's."""
    grads, loss, sums, count = jax.tree.map(
        jnp.add, (a.grads, a.loss, a.sums, a.count), (b.grads, b.loss, b.sums, b.count)
    )
    return Grads(grads, loss, sums, count, b.model_state, check=_first_check(a.check, b.check))


def accumulate(
    grad_fn: GradFn, m: int, *, stacked: bool = False, per_micro: bool = False
) -> GradFn:
    """``grad_fn`` summed over ``m`` micro-batches in one ``lax.scan`` (less activation memory,
    the same sums as one pass over the whole batch).

    Args:
        grad_fn: the gradient function of one micro-batch.
        m: micro-batches per step.
        stacked: the batch already holds its micro-batches on a leading ``[m, ...]`` axis
            (e.g. DataLoader batches stacked for ``accumulate_grad_batches``); else micro-batch
            ``i`` takes rows ``i, i+m, ...`` (each device's rows stay on that device).
        per_micro: keep each micro-batch's ``(sums, count)`` in :attr:`Grads.each`.

    Example:
        >>> import jax, jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model = jaxcore.linen_model(MLP(features=(8,)))
        >>> batch = {"x": jnp.ones((4, 64)), "y": jnp.zeros(4, jnp.int32)}
        >>> params, ms = model.init(jax.random.key(0), batch)
        >>> fn = accumulate(row_grads(model, jaxcore.softmax_cross_entropy), 2)
        >>> float(fn(params, ms, batch, jax.random.key(1)).count)
        4.0
    """

    if m == 1 and not stacked:
        return grad_fn

    def window_grads(params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array) -> Grads:
        if m == 1:  # a window of one: micro-batch 0, as in a longer window
            one = grad_fn(
                params, model_state, jax.tree.map(lambda v: v[0], batch), jax.random.fold_in(key, 0)
            )
            each = jax.tree.map(lambda v: v[None], (one.sums, one.count)) if per_micro else None
            return one._replace(each=each)
        micro = batch if stacked else _micro_batches(batch, m)

        def body(acc: Grads, xs: Any) -> tuple[Grads, Any]:
            i, mb = xs
            g = grad_fn(params, acc.model_state, mb, jax.random.fold_in(key, i))
            return _add(acc, g), ((g.sums, g.count) if per_micro else None)

        first = jax.tree.map(lambda v: v[0], micro)
        shapes = jax.eval_shape(grad_fn, params, model_state, first, key)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)._replace(
            model_state=model_state,
            check=None if shapes.check is None else jnp.array(NO_CHECK, jnp.int32),
        )
        total, each = jax.lax.scan(body, zeros, (jnp.arange(m), micro))
        return total._replace(each=each)

    loop_free = (accumulate(grad_fn, 1, stacked=True) if stacked else grad_fn) if m > 1 else None
    return Window(window_grads, _joined_stacked if stacked else _identity, loop_free)


def _identity(batch: Batch) -> Batch:
    """A batch split into micro-batches by :func:`accumulate` is already one batch of rows."""
    return batch


def unrolled(grad_fn: GradFn, *, per_micro: bool = False) -> GradFn:
    """``grad_fn`` summed over a sequence of micro-batches whose shapes may differ (an
    accumulation window holding a ragged last batch), unrolled instead of scanned; micro-batch
    ``i`` draws ``fold_in(key, i)`` as when stacked.

    Example:
        >>> import jax, jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> model = jaxcore.linen_model(MLP(features=(8,)))
        >>> window = [{"x": jnp.ones((n, 64)), "y": jnp.zeros(n, jnp.int32)} for n in (4, 3)]
        >>> params, ms = model.init(jax.random.key(0), window[0])
        >>> grad_fn = unrolled(row_grads(model, jaxcore.softmax_cross_entropy))
        >>> g = grad_fn(params, ms, window, jax.random.key(1))
        >>> float(g.count)
        7.0
    """

    def grad_sums(
        params: PyTree, model_state: PyTree, batch: Sequence[Batch], key: jax.Array
    ) -> Grads:
        total: Grads | None = None
        each = []
        for i, mb in enumerate(batch):
            state = model_state if total is None else total.model_state
            g = grad_fn(params, state, mb, jax.random.fold_in(key, i))
            total = g if total is None else _add(total, g)
            each.append((g.sums, g.count))
        assert total is not None, "an unrolled window holds at least one micro-batch"
        stacked = jax.tree.map(lambda *v: jnp.stack(v), *each) if per_micro else None
        return total._replace(each=stacked)

    return Window(grad_sums, _joined_unrolled)
