"""``Tensor.index_reduce`` / ``index_reduce_`` (``prod``, ``mean``, ``amax``, ``amin``, with or
without ``include_self``) in JAX, with torch's own gradient.

torchax 0.0.13 has no lowering (the trace stopped with coreshell's refusal); a graph model's
``h.index_reduce_(0, dst, messages, "amax")`` is a common aggregation. The values are JAX
scatters; the gradient is torch's formula (``index_reduce_backward`` in torch's
``FunctionsManual.cpp``), because JAX's own differs where it matters: ``scatter_mul`` has no
gradient for repeated indices, and torch splits a tie of ``amax``/``amin`` evenly between
the tied elements. ``index_reduce_`` runs as this op and a copy (:mod:`._inplace`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from torchshell._errors import TorchModelError

__all__ = ["index_reduce"]

_MODES = ("prod", "mean", "amax", "amin")


def index_reduce(
    x: jax.Array,
    dim: int,
    index: jax.Array,
    source: jax.Array,
    reduce: str,
    *,
    include_self: bool = True,
) -> jax.Array:
    """``torch.index_reduce(x, dim, index, source, reduce, include_self=...)``.

    Example:
        >>> import torch
        >>> x, i, s = torch.ones(3, 2), torch.tensor([0, 2, 0]), torch.arange(6.0).view(3, 2)
        >>> want = x.index_reduce(0, i, s, "amax", include_self=False)
        >>> got = index_reduce(jnp.ones((3, 2)), 0, jnp.array([0, 2, 0]),
        ...                    jnp.arange(6.0).reshape(3, 2), "amax", include_self=False)
        >>> bool((got == jnp.asarray(want.numpy())).all())
        True
    """
    if reduce not in _MODES:
        raise TorchModelError(
            f"index_reduce(reduce={reduce!r}): torch takes one of {_MODES}. Fix: use one of "
            "them (index_add_ for a sum)."
        )
    if x.ndim == 0:  # (torch: a 0-d self, a 0-d or one-element source)
        out = index_reduce(
            x.reshape(1), 0, index, source.reshape(1), reduce, include_self=include_self
        )
        return out.reshape(())
    dim = dim % x.ndim
    moved = _reduce(
        jnp.moveaxis(x, dim, 0),
        jnp.reshape(index, (-1,)).astype(jnp.int32),
        jnp.moveaxis(source.reshape(source.shape or (1,)), dim, 0),
        reduce,
        bool(include_self),
    )
    return jnp.moveaxis(moved, 0, dim)


def _hit(x: jax.Array, index: jax.Array) -> jax.Array:
    """Where ``index`` writes: ``[N, 1, ...]`` booleans."""
    hit = jnp.zeros((x.shape[0],), bool).at[index].set(True)
    return hit.reshape((-1,) + (1,) * (x.ndim - 1))


def _extreme(dtype: Any, high: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf if high else -jnp.inf
    info = jnp.iinfo(dtype)
    return info.max if high else info.min


def _forward(x: jax.Array, index: jax.Array, src: jax.Array, reduce: str, keep: bool) -> Any:
    hit = _hit(x, index)
    if reduce == "mean":
        base = x if keep else jnp.where(hit, jnp.zeros_like(x), x)
        total = base.at[index].add(src)
        ones = jnp.ones(src.shape, x.dtype)
        n = (jnp.ones_like(x) if keep else jnp.zeros_like(x)).at[index].add(ones)
        n = jnp.where(n == 0, jnp.ones_like(n), n)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.where(hit, total / n, x)
        return jnp.where(hit, jnp.floor_divide(total, n), x)
    if reduce == "prod":
        base = x if keep else jnp.where(hit, jnp.ones_like(x), x)
        return base.at[index].multiply(src)
    high = reduce == "amin"  # (the neutral start of a min is the highest value)
    base = x if keep else jnp.where(hit, jnp.full_like(x, _extreme(x.dtype, high)), x)
    return base.at[index].min(src) if high else base.at[index].max(src)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _reduce(x: jax.Array, index: jax.Array, src: jax.Array, reduce: str, keep: bool) -> Any:
    return _forward(x, index, src, reduce, keep)


def _reduce_fwd(x: Any, index: Any, src: Any, reduce: str, keep: bool) -> Any:
    out = _forward(x, index, src, reduce, keep)
    return out, (x, index, src, out)


def _reduce_bwd(reduce: str, keep: bool, saved: Any, grad: jax.Array) -> Any:
    """torch's ``index_reduce_backward``, on the moved axis 0."""
    x, index, src, result = saved
    if reduce == "prod":
        masked_self = jnp.where(x == 0, jnp.ones_like(x), x)
        grad_self = grad * _forward(masked_self, index, src, reduce, keep) / masked_self
        src_zero = src == 0
        zeros = jnp.zeros_like(x).at[index].add(src_zero.astype(x.dtype))[index]
        single = src_zero & (zeros == 1)
        masked_src_result = _forward(
            x, index, jnp.where(single, jnp.ones_like(src), src), reduce, keep
        )
        grad_src = jnp.where(
            single,
            (grad * masked_src_result)[index],
            (grad * result)[index] / jnp.where(src_zero, jnp.ones_like(src), src),
        )
    elif reduce == "mean":
        n = (
            (jnp.ones_like(grad) if keep else jnp.zeros_like(grad))
            .at[index]
            .add(jnp.ones_like(src))
        )
        n = jnp.where(n == 0, jnp.ones_like(n), n)
        grad_self, grad_src = grad / n, grad[index] / n[index]
    else:  # amax, amin: a tie's gradient split evenly between the tied elements
        self_is = (x == result).astype(grad.dtype)
        src_is = (src == result[index]).astype(grad.dtype)
        split = grad / self_is.at[index].add(src_is)
        grad_self, grad_src = self_is * split, src_is * split[index]
    if not keep:
        grad_self = jnp.where(_hit(x, index), jnp.zeros_like(grad_self), grad_self)
    return grad_self, None, grad_src


_reduce.defvjp(_reduce_fwd, _reduce_bwd)
