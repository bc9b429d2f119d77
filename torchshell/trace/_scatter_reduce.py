"""``Tensor.scatter_reduce`` / ``scatter_reduce_`` in JAX, with torch's own gradient (issue #52).

torchax 0.0.13 lowers it with JAX scatters and lets JAX differentiate them: ``prod`` stopped
the trace (``scatter_mul`` has no gradient for repeated indices), and ``amax``/``amin``
without ``include_self`` gave each tied source element the whole gradient where torch splits
it evenly between the tied elements, silently. The scatter is the flat one of
:func:`~torchshell.trace._index_reduce.index_reduce` (each element of ``index`` names one
element of ``self``: its own position with ``index``'s value along ``dim``), whose gradient
is torch's ``scatter_reduce_backward`` (the same formulas as ``index_reduce_backward``). The
in-place ``scatter_reduce_`` runs as this op and a copy (torchax's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshell._errors import TorchModelError
from torchshell.trace._index_reduce import index_reduce

__all__ = ["scatter_reduce", "scatter_reduce_lowerings"]

_MODES = ("sum", "prod", "mean", "amax", "amin")


def _targets(shape: tuple[int, ...], dim: int, index: jax.Array) -> jax.Array:
    """The flat position in a tensor of ``shape`` each element of ``index`` writes to."""
    strides = np.cumprod((1, *shape[:0:-1]))[::-1]  # (row-major, as ravel)
    coords = np.indices(index.shape, dtype=np.int32)
    flat = jnp.zeros(index.shape, jnp.int32)
    for axis, stride in enumerate(strides):
        along = index.astype(jnp.int32) if axis == dim else jnp.asarray(coords[axis])
        flat = flat + along * int(stride)
    return flat.reshape(-1)


def scatter_reduce(
    x: jax.Array,
    dim: int,
    index: jax.Array,
    src: jax.Array,
    reduce: str,
    *,
    include_self: bool = True,
) -> jax.Array:
    """``torch.scatter_reduce(x, dim, index, src, reduce, include_self=...)``.

    Example:
        >>> import torch
        >>> x, i = torch.ones(2, 3), torch.tensor([[0, 1, 0], [0, 0, 1]])
        >>> s = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
        >>> want = x.scatter_reduce(0, i, s, "prod")
        >>> got = scatter_reduce(jnp.ones((2, 3)), 0, jnp.asarray(i.numpy()),
        ...                      jnp.asarray(s.numpy()), "prod")
        >>> bool((got == jnp.asarray(want.numpy())).all())
        True
    """
    if reduce not in _MODES:
        raise TorchModelError(
            f"scatter_reduce(reduce={reduce!r}): torch takes one of {_MODES}. Fix: use one of them."
        )
    shape = x.shape or (1,)  # (0-d tensors: as one-element ones)
    index = index.reshape(index.shape or (1,))
    src = src.reshape(src.shape or (1,))
    if index.size == 0:
        return x
    dim = dim % len(shape)
    taken = src[tuple(slice(0, n) for n in index.shape)]  # (torch reads index's extent)
    flat = x.reshape(-1)
    if reduce == "sum":
        base = flat if include_self else flat.at[_targets(shape, dim, index)].set(0)
        out = base.at[_targets(shape, dim, index)].add(taken.reshape(-1).astype(x.dtype))
    else:
        out = index_reduce(
            flat,
            0,
            _targets(shape, dim, index),
            taken.reshape(-1).astype(x.dtype),
            reduce,
            include_self=include_self,
        )
    return out.reshape(x.shape)


def scatter_reduce_lowerings() -> dict[Any, Any]:
    """``aten.scatter_reduce.two`` for the trace's environment (:mod:`._env`)."""
    return {
        torch.ops.aten.scatter_reduce: scatter_reduce,  # (the packet: torchax's lowering's key)
        torch.ops.aten.scatter_reduce.two: scatter_reduce,
    }
