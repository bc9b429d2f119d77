"""A batch's rows: jaxcore's one definition (the step's masks, sums and micro-batches).

The shell's other one is :func:`bridge.rows` (Lightning's batch size: the first tensor's rows,
in the batch's own order) with :func:`bridge.round_up` (rows rounded up to the data axis);
``tests/test_layout.py`` refuses a third.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcore._errors import BatchError

__all__ = ["rows"]


def rows(batch: Any, axis: int = 0, *, default: int | None = None) -> int:
    """The batch's rows: the size of ``axis`` common to every array of ``batch`` that has it.

    Any pytree (a dict, a tuple, nested) of JAX, numpy or torch arrays; leaves without that
    axis (0-d arrays, strings, numbers) hold none.

    Args:
        batch: the batch.
        axis: the axis counted (1: the rows of K stacked batches ``[K, B, ...]``).
        default: returned instead of raising when the arrays do not share one size.

    Returns:
        The row count.

    Raises:
        BatchError: no array has the axis, or the arrays' sizes differ (and no ``default``).

    Example:
        >>> import jax.numpy as jnp
        >>> rows({"x": jnp.ones((4, 2)), "y": jnp.ones(4), "t": jnp.float32(1)})
        4
        >>> rows([jnp.ones(3), jnp.ones(4)], default=0), rows(jnp.ones((2, 5)), axis=1)
        (0, 5)
    """
    sizes = {v.shape[axis] for v in jax.tree.leaves(batch) if getattr(v, "ndim", 0) > axis}
    if len(sizes) == 1:
        return int(sizes.pop())
    if default is not None:
        return default
    if not sizes:
        where = "" if axis == 0 else f" with an axis {axis}"
        raise BatchError(
            f"The batch has no array fields{where}. Fix: pass a dict of [B, ...] arrays."
        )
    named = {
        jax.tree_util.keystr(path): v.shape[axis]
        for path, v in jax.tree_util.tree_leaves_with_path(batch)
        if getattr(v, "ndim", 0) > axis
    }
    raise BatchError(
        f"Every batch field needs the same number of rows, got {named}. "
        "Fix: collate the fields of one example together."
    )
