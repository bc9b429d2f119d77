"""Where a batch holds NaN/Inf, located on device (``nan_policy="stop"``'s input check).

Re-exported by :mod:`jaxcore.guard`, which uses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

__all__ = ["INPUT_ROWS", "NO_INPUT", "input_where", "window_input_where"]

INPUT_ROWS = 5  # how many bad rows of an input field the state remembers
NO_INPUT = (-1,) * (2 + INPUT_ROWS)  # ``TrainState.nonfinite_input`` while every input is finite


def input_where(batch: PyTree) -> jax.Array:
    """Where a batch holds NaN/Inf, on device: ``int32[2 + INPUT_ROWS]``.

    ``[field, rows, r0, r1, ...]``: the first floating field holding NaN/Inf (its index among
    the batch's floating leaves, in ``jax.tree.leaves`` order), that field's row count and
    its first bad rows (-1 filled); :data:`NO_INPUT` when every floating field is finite.
    One ``isfinite`` reduction per field; the rows are located only when one is bad.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((4, 3)).at[2, 1].set(jnp.nan)
        >>> input_where({"x": x, "y": jnp.zeros(4, jnp.int32)}).tolist()
        [0, 4, 2, -1, -1, -1, -1]
    """
    floats = [v for v in jax.tree.leaves(batch) if jnp.issubdtype(v.dtype, jnp.inexact)]
    bad = [
        jnp.any(~jnp.isfinite(v.reshape(v.shape[0], -1) if v.ndim else v[None, None]), 1)
        for v in floats
    ]
    none = jnp.array(NO_INPUT, jnp.int32)
    if not bad:
        return none

    def locate() -> jax.Array:
        where = none
        for i, rows in reversed(list(enumerate(bad))):  # the first bad field wins
            first = jnp.nonzero(rows, size=INPUT_ROWS, fill_value=-1)[0].astype(jnp.int32)
            here = jnp.concatenate([jnp.array([i, rows.shape[0]], jnp.int32), first])
            where = jnp.where(jnp.any(rows), here, where)
        return where

    return jax.lax.cond(jnp.any(jnp.stack([b.any() for b in bad])), locate, lambda: none)


def window_input_where(
    batches: PyTree, k: int, rows: Callable[[PyTree], PyTree] = lambda b: b
) -> jax.Array:
    """:func:`input_where` of each of ``k`` stacked batches (every field ``[k, ...]``), at once:
    ``int32[k, 2 + INPUT_ROWS]``.

    One ``isfinite`` reduction over the whole window instead of one per step inside the
    K-step loop (where a conditional per step broke the loop body's fusion: ~10% of a small
    MLP's step on CPU). Only the first bad batch of the window is located (under ``"stop"``
    every later step is refused anyway, and only the first refused step's input is kept);
    every other row is :data:`NO_INPUT`.

    Args:
        batches: ``k`` batches stacked on a leading axis.
        k: the number of batches.
        rows: one step's batch as one batch of rows (see :func:`jaxcore.train_step`).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((3, 4, 2)).at[1, 2, 0].set(jnp.inf).at[2, 0, 0].set(jnp.nan)
        >>> window_input_where({"x": x}, 3)[:, :3].tolist()
        [[-1, -1, -1], [0, 4, 2], [-1, -1, -1]]
    """
    none = jnp.broadcast_to(jnp.array(NO_INPUT, jnp.int32), (k, len(NO_INPUT)))
    floats = [v for v in jax.tree.leaves(batches) if jnp.issubdtype(v.dtype, jnp.inexact)]
    if not floats:
        return none
    bad = jnp.stack([jnp.any(~jnp.isfinite(v.reshape(k, -1)), 1) for v in floats]).any(0)

    def locate() -> jax.Array:
        first = jnp.argmax(bad)  # the first bad batch of the window
        one = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, first, 0, False), batches)
        return jnp.where((jnp.arange(k) == first)[:, None], input_where(rows(one)), none)

    return jax.lax.cond(bad.any(), locate, lambda: none)
