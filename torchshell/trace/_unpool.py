"""``F.max_unpool1d/2d/3d`` (``nn.MaxUnpool*d``) in one scatter, with torch's gradient.

torchax 0.0.13 writes the output one input element at a time (a Python loop of ``.at[].set``
over every element: slow to trace), and where two inputs name the same output position (the
indices of overlapping pooling windows) only the written one got a gradient; torch's
``max_unpool*d`` backward gathers the output's gradient at every input's index, so each of
them gets it. Here the forward keeps torch CPU's rule for such a position (the last input
written, in order) and the gradient is torch's gather. (torch's op database found it:
``make opinfo``.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

__all__ = ["max_unpool", "unpool_lowerings"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _unpool(x: jax.Array, index: jax.Array, width: int) -> jax.Array:
    """``x`` ``[R, K]`` written at ``index`` ``[R, K]`` into ``R`` rows of ``width``."""
    rows = jnp.arange(x.shape[0])[:, None]
    order = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
    last = jnp.full((x.shape[0], width), -1, jnp.int32).at[rows, index].max(order)
    taken = jnp.take_along_axis(x, jnp.maximum(last, 0), axis=1)  # (the last written wins)
    return jnp.where(last >= 0, taken, jnp.zeros_like(taken))


def _unpool_fwd(x: jax.Array, index: jax.Array, width: int) -> tuple[jax.Array, Any]:
    return _unpool(x, index, width), index


def _unpool_bwd(width: int, index: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    return jnp.take_along_axis(g, index, axis=1), None


_unpool.defvjp(_unpool_fwd, _unpool_bwd)


def max_unpool(
    x: jax.Array,
    indices: jax.Array,
    output_size: Sequence[int],
    stride: Any = None,
    padding: Any = None,
) -> jax.Array:
    """``aten::max_unpool2d`` / ``max_unpool3d`` (``F.max_unpool1d`` runs as the 2-d one):
    ``x`` and ``indices`` ``[N, C, *in]`` (or ``[C, *in]``), each index a flat position in
    the ``output_size`` plane of its channel.

    Example:
        >>> x, i = jnp.array([[[[5.0, 7.0]]]]), jnp.array([[[[1, 1]]]])
        >>> max_unpool(x, i, [1, 3]).tolist()
        [[[[0.0, 7.0, 0.0]]]]
    """
    del stride, padding  # (the indices already say where)
    size = tuple(int(n) for n in output_size)
    lead = x.shape[: x.ndim - len(size)]
    rows = math.prod(lead)
    flat = x.reshape(rows, -1)
    index = indices.reshape(rows, -1).astype(jnp.int32)
    return _unpool(flat, index, math.prod(size)).reshape(lead + size)


def unpool_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops lowered here, for the trace's environment."""
    aten = torch.ops.aten
    return {aten.max_unpool2d.default: max_unpool, aten.max_unpool3d.default: max_unpool}
