"""Vector norms (and the distances and standard deviation built on one) with torch's gradient
where the norm is 0.

A norm is ``sqrt`` of a sum of squares: at a zero vector its gradient is ``0 / 0``. torchax
0.0.13 differentiates its ``jnp.sqrt(sum(x**2))`` and gets NaN; torch's ``norm_backward``
(and ``std_backward``) define it as 0 there. So one zero vector (a padded row, a point's
distance to itself) under ``F.normalize``, ``x.norm()``, ``torch.cdist``/``F.pdist``/
``torch.dist`` or ``std`` made every weight NaN after one step where torch trains on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch


def _axes(dim: Any, ndim: int) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and not len(dim)):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % max(ndim, 1) for d in dims))


def _sgn(x: jax.Array) -> jax.Array:
    return jnp.sign(x)  # 0 at 0, as torch's sgn


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _norm(x: jax.Array, p: float, axes: tuple[int, ...], keepdim: bool) -> jax.Array:
    a = jnp.abs(x)
    if p == 0:
        return jnp.sum((x != 0).astype(x.dtype), axes, keepdims=keepdim)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axes, keepdims=keepdim))
    if p == math.inf:
        return jnp.max(a, axes, keepdims=keepdim)
    if p == -math.inf:
        return jnp.min(a, axes, keepdims=keepdim)
    if p == 1:
        return jnp.sum(a, axes, keepdims=keepdim)
    return jnp.sum(a**p, axes, keepdims=keepdim) ** (1.0 / p)


@_norm.defjvp
def _norm_jvp(
    p: float, axes: tuple[int, ...], keepdim: bool, primals: Any, tangents: Any
) -> tuple[jax.Array, jax.Array]:
    """torch's ``norm_backward``: the gradient of the norm with respect to ``x``."""
    (x,), (t,) = primals, tangents
    out = _norm(x, p, axes, keepdim)
    n = out if keepdim else jnp.expand_dims(out, axes)
    zero = jnp.zeros((), x.dtype)
    if p == 0:
        return out, jnp.zeros_like(out)
    if p == 1:
        g = _sgn(x)
    elif p == 2:
        g = jnp.where(n == 0, zero, x / jnp.where(n == 0, 1, n))
    elif math.isinf(p):
        mask = ((jnp.abs(x) == n) | jnp.isnan(x)).astype(x.dtype)
        g = _sgn(x) * mask / jnp.sum(mask, axes, keepdims=True)
    elif p < 1:
        a = jnp.abs(x)
        g = _sgn(x) * jnp.where(x == 0, zero, jnp.where(x == 0, 1, a) ** (p - 1)) * n ** (1 - p)
    else:
        scale = jnp.where(n == 0, zero, jnp.where(n == 0, 1, n) ** (1 - p))
        a = jnp.abs(x)
        g = (_sgn(x) * a ** (p - 1) if p < 2 else x * a ** (p - 2)) * scale
    return out, jnp.sum(g * t, axes, keepdims=keepdim)


def vector_norm(
    x: jax.Array, ord: Any = 2, dim: Any = None, keepdim: bool = False, dtype: Any = None
) -> jax.Array:
    """``torch.linalg.vector_norm`` (``x.norm(p, dim)``, ``F.normalize``)."""
    if dtype is not None:
        from torchax.ops import mappings

        x = x.astype(mappings.t2j_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    p = 2.0 if ord == "fro" else float(ord)
    return _norm(x, p, _axes(dim, x.ndim), bool(keepdim))


def dist(x: jax.Array, other: jax.Array, p: Any = 2) -> jax.Array:
    """``torch.dist``: the ``p``-norm of ``x - other``."""
    return vector_norm(x - other, p)


def cdist(x1: jax.Array, x2: jax.Array, p: float, compute_mode: Any = None) -> jax.Array:
    """``torch.cdist``: ``[..., P, M]`` x ``[..., Q, M]`` -> ``[..., P, Q]``."""
    return vector_norm(x1[..., :, None, :] - x2[..., None, :, :], p, -1)


def _sqrt0(sq: jax.Array) -> jax.Array:
    """``sqrt`` with gradient 0 at 0."""
    zero = sq == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, sq))).astype(sq.dtype)


def cdist_function(
    x1: jax.Array,
    x2: jax.Array,
    p: float = 2.0,
    compute_mode: str | None = "use_mm_for_euclid_dist_if_necessary",
) -> jax.Array:
    """``torch.cdist`` as torch computes it: for ``p = 2`` with more than 25 rows (or
    ``use_mm_for_euclid_dist``) by one matmul (``|a|^2 + |b|^2 - 2 a.b``, clamped at 0),
    else directly; the gradient is 0 at distance 0 either way."""
    x1 = x1.astype(jnp.promote_types(x1.dtype, jnp.float32))
    x2 = x2.astype(x1.dtype)
    mode = compute_mode or "use_mm_for_euclid_dist_if_necessary"
    many = x1.shape[-2] > 25 or x2.shape[-2] > 25
    if p == 2 and (mode == "use_mm_for_euclid_dist" or (many and mode.endswith("necessary"))):
        sq = (
            jnp.sum(x1 * x1, -1)[..., :, None]
            + jnp.sum(x2 * x2, -1)[..., None, :]
            - 2 * jnp.matmul(x1, jnp.swapaxes(x2, -1, -2))
        )
        return _sqrt0(jnp.maximum(sq, 0))
    return cdist(x1, x2, p)


def pdist(x: jax.Array, p: float = 2) -> jax.Array:
    """``F.pdist``: the upper triangle (row-major) of ``cdist(x, x)``."""
    rows, cols = jnp.triu_indices(x.shape[0], k=1)
    return vector_norm(x[rows] - x[cols], p, -1)


def _std(x: jax.Array, axes: tuple[int, ...], correction: float, keepdim: bool) -> jax.Array:
    """``sqrt(var)`` whose gradient is 0 where the deviation is 0 (torch's ``std_backward``)."""
    var = jnp.var(x, axes, ddof=correction, keepdims=keepdim)  # type: ignore[arg-type]
    zero = var == 0
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, var))).astype(var.dtype)


def std(x: jax.Array, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    """``torch.std`` (``aten.std.correction``)."""
    c = 1.0 if correction is None else float(correction)
    return _std(x, _axes(dim, x.ndim), c, bool(keepdim))


def std_mean(
    x: jax.Array, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``torch.std_mean`` (``aten.std_mean.correction``)."""
    axes = _axes(dim, x.ndim)
    return std(x, dim, correction=correction, keepdim=keepdim), jnp.mean(
        x, axes, keepdims=bool(keepdim)
    )


def norm_lowerings() -> dict[Any, Callable[..., Any]]:
    """aten op -> lowering, for :func:`torchshell.trace.environment`."""
    aten = torch.ops.aten
    return {
        aten.linalg_vector_norm.default: vector_norm,
        aten.dist.default: dist,
        aten._cdist_forward.default: cdist,
        torch.cdist: cdist_function,  # (torchax lowers the function, before aten)
        aten._pdist_forward.default: pdist,
        aten.std.correction: std,
        aten.std_mean.correction: std_mean,
    }
