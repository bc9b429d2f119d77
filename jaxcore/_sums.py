"""A step's arithmetic over the rows of a batch: masks, masked sums, micro-batches.

Losses and metrics are exact masked means: each (micro-)batch gives masked *sums* and its
count of valid rows, and the step divides once (:mod:`jaxcore.step`, :mod:`jaxcore.eval_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxcore._errors import BatchError
from jaxcore._rows import rows
from jaxcore.losses import TOTAL
from jaxcore.model import Batch, ModelFns
from jaxcore.precision import cast_floating

PyTree = Any
LossFn = Callable[[PyTree, Batch], tuple[jax.Array, dict[str, jax.Array]]]
Metrics = dict[str, jax.Array]


def _mask(batch: Batch, n: int) -> jax.Array:
    mask = batch.get("mask") if isinstance(batch, Mapping) else None
    return jnp.ones((n,), bool) if mask is None else mask


def _inputs(batch: Batch, dtype: Any) -> Batch:
    """Floating batch fields in the compute dtype (the mask and labels untouched)."""
    if dtype is None:
        return batch
    if isinstance(batch, Mapping):
        return {k: v if k == "mask" else cast_floating(v, dtype) for k, v in batch.items()}
    return cast_floating(batch, dtype)


def _reduce(values: jax.Array, mask: Any, count: jax.Array, name: str = "") -> jax.Array:
    """Masked sum of per-example ``values[B]``; a 0-d value is a batch mean (sum = v x rows).

    A :data:`TOTAL` metric is returned as it is.
    """
    values = values.astype(jnp.float32)
    if name.startswith(TOTAL):
        return values
    if values.ndim == 0:
        return values * count
    return jnp.sum(values * mask)


def _forward(
    model: ModelFns, params: PyTree, model_state: PyTree, batch: Batch, key: jax.Array, dtype: Any
) -> tuple[PyTree, PyTree]:
    """The training-mode forward pass: float32 outputs and the new model state."""
    outputs, new_state = model.apply(
        cast_floating(params, dtype), model_state, _inputs(batch, dtype), key, True
    )
    return cast_floating(outputs, jnp.float32), new_state


def _weights(batch: Batch, weigh_rows: bool) -> tuple[jax.Array | None, jax.Array]:
    """The rows' float mask and its count; ``(None, 1)`` when the batch weighs one."""
    if not weigh_rows:
        return None, jnp.float32(1.0)
    mask = _mask(batch, rows(batch)).astype(jnp.float32)
    return mask, jnp.sum(mask)


def _sums(
    model: ModelFns,
    loss_fn: LossFn,
    params: PyTree,
    model_state: PyTree,
    batch: Batch,
    key: jax.Array,
    dtype: Any,
    weigh_rows: bool = True,
) -> tuple[jax.Array, tuple[PyTree, Metrics, jax.Array]]:
    """Masked *sums* of loss and metrics on one (micro-)batch, and its valid-row count.

    ``weigh_rows=False``: the batch weighs one whatever its rows (its values are means).
    """
    outputs, new_state = _forward(model, params, model_state, batch, key, dtype)
    losses, metrics = loss_fn(outputs, batch)
    mask, count = _weights(batch, weigh_rows)
    if not weigh_rows:
        for name, v in {"loss": losses, **metrics}.items():
            if jnp.ndim(v) and not name.startswith(TOTAL):
                raise BatchError(
                    f"weigh_rows=False takes batch means, got {name!r} of shape "
                    f"{jnp.shape(v)}. Fix: return 0-d means, or weigh_rows=True."
                )
    sums = {k: _reduce(v, mask, count, k) for k, v in metrics.items()}
    if dtype is not None:  # model state (e.g. batch_stats) keeps its own dtypes
        new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
    return _reduce(losses, mask, count), (new_state, sums, count)


def _joined_stacked(batch: Batch) -> Batch:
    """Stacked micro-batches ``[m, B, ...]`` as one batch of ``m * B`` rows (a bad row is
    numbered within the window)."""
    return jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), batch)


def _joined_unrolled(batch: Batch) -> Batch:
    """A sequence of micro-batches of other shapes as one batch of rows: each field first one
    value per row (:func:`_row_flags`), then joined."""
    return jax.tree.map(lambda *v: jnp.concatenate([_row_flags(x) for x in v]), *batch)


def _row_flags(v: jax.Array) -> jax.Array:
    """One value per row of ``v``: NaN where a floating row holds NaN/Inf, else 0 (the input
    check's view of the row, whatever the field's trailing shape)."""
    if not v.ndim:
        v = v[None]
    if not jnp.issubdtype(v.dtype, jnp.inexact):
        return jnp.zeros(v.shape[0], v.dtype)
    finite = jnp.isfinite(v.reshape(v.shape[0], -1)).all(1)
    return jnp.where(finite, 0, jnp.nan).astype(v.dtype)


def _drop_leading_axes(batch: Batch, n: int) -> Batch:
    """The abstract batch of one optimizer step's one micro-batch (``n`` stacked axes off)."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[n:], v.dtype), batch)


def _micro_batches(batch: Batch, m: int) -> Batch:
    """``[B, ...] -> [m, B/m, ...]``; micro-batch ``i`` takes rows ``i, i+m, ...`` so each
    device's rows stay on that device."""
    n = rows(batch)
    if n % m:
        raise BatchError(
            f"accum_steps={m} must divide the batch rows, got {n} rows. Fix: make the "
            f"global batch size a multiple of {m}, or change accum_steps."
        )
    return jax.tree.map(lambda v: jnp.swapaxes(v.reshape(n // m, m, *v.shape[1:]), 0, 1), batch)
