"""Ops torch's op database found refused by torchax that JAX computes alike (issue #52).

torchax failed on each of these with a message whose fix ("call it with other arguments")
could not be followed: ``torch.normal(mean, std, size)`` of two numbers (its lowering took no
``dtype``), ``torch.lu_unpack`` (slice bounds built as arrays, which JAX 0.7 refuses),
``torch.linalg.householder_product`` (no gradient rule in JAX), ``torch.ormqr`` and
``torch.segment_reduce`` (no lowering; ``prod`` stays refused), antialiased bilinear
``F.interpolate`` (torchax's lowering called a tuple). Here each is written with
JAX ops whose values and gradients are torch's (``tests/torchshell/test_silent_ops_refused.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

__all__ = ["refused_env_lowerings", "refused_lowerings"]


def normal_float_float(
    mean: float,
    std: float,
    size: Sequence[int],
    *,
    generator: Any = None,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    env: Any,
) -> jax.Array:
    """``torch.normal(mean, std, size)`` of two numbers: a draw from the trace's key.

    Example:
        >>> import torchax
        >>> env = torchax.tensor.Environment()  # (a trace's own; not the process-wide one)
        >>> normal_float_float(1.0, 0.5, (2, 3), env=env).shape
        (2, 3)
    """
    del layout, device, pin_memory  # (JAX's own)
    key = env.get_and_rotate_prng_key(generator)
    out = jax.random.normal(key, tuple(size), jnp.float32) * std + mean
    if dtype is not None:
        from torchax import interop  # (imported here, as torchax itself is: see _env.py)

        return out.astype(interop.jax_view(dtype))
    return out


def lu_unpack(
    lu: jax.Array, pivots: jax.Array, unpack_data: bool = True, unpack_pivots: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``torch.lu_unpack``: ``P, L, U`` with ``A = P @ L @ U`` (pivots 1-based, as torch's).

    Example:
        >>> lu = jnp.array([[2.0, 1.0], [0.5, 3.0]])
        >>> p, l, u = lu_unpack(lu, jnp.array([2, 2]))
        >>> (p @ l @ u).tolist()
        [[1.0, 3.5], [2.0, 1.0]]
    """
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    low, up = empty, empty
    if unpack_data:
        low = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        up = jnp.triu(lu[..., :k, :])
    perm = empty
    if unpack_pivots:
        order = jax.lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
        perm = jnp.swapaxes(jax.nn.one_hot(order, m, dtype=lu.dtype), -1, -2)
    return perm, low, up


def _reflections(a: jax.Array, tau: jax.Array) -> jax.Array:
    """``H_1 H_2 ... H_k`` (``m x m``), ``H_i = I - tau_i v_i v_i^H``, ``v_i`` below ``a``'s
    diagonal with a unit ``i``-th entry: differentiable as a product of matrices."""
    m = a.shape[-2]
    rows = jnp.arange(m)
    q = jnp.broadcast_to(jnp.eye(m, dtype=jnp.result_type(a, tau)), (*a.shape[:-2], m, m))
    for i in range(tau.shape[-1]):
        v = jnp.where(rows > i, a[..., :, i], 0).at[..., i].set(1)
        qv = jnp.einsum("...ij,...j->...i", q, v)
        q = q - tau[..., i, None, None] * qv[..., :, None] * jnp.conj(v)[..., None, :]
    return q


def householder_product(a: jax.Array, tau: jax.Array) -> jax.Array:
    """``torch.linalg.householder_product`` (``orgqr``): the first ``n`` columns of the
    product of ``a``'s reflections, with gradients (JAX's own op has none).

    Example:
        >>> a, tau = jnp.array([[1.0, 0.0], [0.5, 1.0]]), jnp.array([0.8, 0.0])
        >>> q = householder_product(a, tau)
        >>> bool(jnp.allclose(q, jax.lax.linalg.householder_product(a, tau)))
        True
    """
    return _reflections(a, tau)[..., :, : a.shape[-1]]


def ormqr(
    a: jax.Array, tau: jax.Array, other: jax.Array, left: bool = True, transpose: bool = False
) -> jax.Array:
    """``torch.ormqr``: ``other`` times the reflections' product ``Q`` (``Q^H`` when
    ``transpose``), from the left or the right.

    Example:
        >>> a, tau = jnp.array([[1.0, 0.0], [0.5, 1.0]]), jnp.array([0.8, 0.0])
        >>> c = jnp.eye(2)
        >>> bool(jnp.allclose(ormqr(a, tau, c), householder_product(a, tau)))
        True
    """
    q = _reflections(a, tau)
    if transpose:
        q = jnp.conj(jnp.swapaxes(q, -1, -2))
    return q @ other if left else other @ q


def segment_reduce(
    data: jax.Array,
    reduce: str,
    *,
    lengths: jax.Array | None = None,
    indices: jax.Array | None = None,
    offsets: jax.Array | None = None,
    axis: int = 0,
    unsafe: bool = False,
    initial: float | None = None,
) -> jax.Array:
    """``torch.segment_reduce`` over 1-D ``lengths`` or ``offsets`` (traced values too):
    ``sum``, ``mean``, ``max`` and ``min`` (``prod`` is left to torchax's refusal: JAX's
    product scatter has no gradient), ``initial`` for the empty segments (and folded into
    ``max``/``min``/``sum``, as torch); a tie's gradient split
    evenly, as torch's ``_segment_reduce_backward``.

    Example:
        >>> x = jnp.array([1.0, 3.0, 3.0, 2.0])
        >>> segment_reduce(x, "max", lengths=jnp.array([3, 1])).tolist()
        [3.0, 2.0]
    """
    del unsafe
    if lengths is None and offsets is not None:
        lengths = jnp.diff(offsets)
    if indices is not None or lengths is None or lengths.ndim != 1:
        raise NotImplementedError("segment_reduce: only 1-D lengths or offsets are lowered")
    x = jnp.moveaxis(data, axis, 0)
    count = lengths.shape[0]
    ends = jnp.cumsum(lengths)
    ids = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
    per = lengths.reshape((count,) + (1,) * (x.ndim - 1))

    def seg(fn: Callable[..., jax.Array], v: jax.Array) -> jax.Array:
        return fn(v, ids, num_segments=count)

    if reduce in ("sum", "mean"):
        out = seg(jax.ops.segment_sum, x) + (0 if initial is None else initial)
        if reduce == "mean":  # (torch: (sum + initial) / length; an empty one: initial)
            out = out / per if initial is None else jnp.where(per == 0, initial, out / per)
    elif reduce in ("max", "min"):
        best = seg(jax.ops.segment_max if reduce == "max" else jax.ops.segment_min, x)
        if initial is not None:
            best = (jnp.maximum if reduce == "max" else jnp.minimum)(best, initial)
        best = jax.lax.stop_gradient(best)
        tie = x == best[ids]
        ties = seg(jax.ops.segment_sum, tie.astype(x.dtype))
        spread = seg(jax.ops.segment_sum, jnp.where(tie, x, 0)) / jnp.maximum(ties, 1)
        out = jnp.where(ties > 0, spread, best)
    else:
        raise NotImplementedError(f"segment_reduce: reduce={reduce!r}")
    return jnp.moveaxis(out.astype(data.dtype), 0, axis)


def _antialiased(
    x: jax.Array, size: Sequence[int], scale: Sequence[float], align_corners: bool
) -> jax.Array:
    """torch's triangle filter, widened by the downscale: JAX's ``scale_and_translate``."""
    if align_corners:
        raise NotImplementedError(
            "antialiased bilinear interpolation with align_corners=True: pass "
            "align_corners=False, or antialias=False (plain bilinear is lowered)"
        )
    out = jax.image.scale_and_translate(
        x,
        (*x.shape[:-2], *(int(n) for n in size)),
        (x.ndim - 2, x.ndim - 1),
        jnp.asarray(scale, jnp.float32),
        jnp.zeros(2),
        method="linear",
        antialias=True,
    )
    return out.astype(x.dtype)


def upsample_bilinear2d_aa(
    x: jax.Array,
    output_size: Sequence[int] | None,
    align_corners: bool,
    scale_factors: Sequence[float] | None = None,
) -> jax.Array:
    """``F.interpolate(x, size or scale_factor, mode="bilinear", antialias=True)``.

    Example:
        >>> upsample_bilinear2d_aa(jnp.ones((1, 1, 4, 4)), (2, 2), False).shape
        (1, 1, 2, 2)
    """
    h, w = x.shape[-2:]
    if output_size is not None:
        return _antialiased(x, output_size, (output_size[0] / h, output_size[1] / w), align_corners)
    assert scale_factors is not None  # (torch passes one of the two)
    size = (int(h * scale_factors[0]), int(w * scale_factors[1]))
    return _antialiased(x, size, scale_factors, align_corners)


def upsample_bilinear2d_aa_sized(
    x: jax.Array,
    output_size: Sequence[int] | None,
    align_corners: bool,
    *scales: Any,
    scale_factors: Sequence[float] | None = None,
    scales_h: float | None = None,
    scales_w: float | None = None,
) -> jax.Array:
    """``aten._upsample_bilinear2d_aa`` of either overload (torch's call through the op's
    packet reaches here with its arguments as given): a size and torch's own scales, or
    ``scale_factors``."""
    if scales and isinstance(scales[0], Sequence):
        scale_factors = scales[0]
    elif scales:
        scales_h, scales_w = (*scales, None)[:2]
    if output_size is None:
        return upsample_bilinear2d_aa(x, None, align_corners, scale_factors)
    h, w = x.shape[-2:]
    scale = (scales_h or output_size[0] / h, scales_w or output_size[1] / w)
    return _antialiased(x, output_size, scale, align_corners)


def max_pool2d_backward(
    grad: jax.Array, x: jax.Array, *pool: Any, indices: jax.Array | None = None
) -> jax.Array:
    """``aten.max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation,
    ceil_mode, indices)``: each gradient added at its index (flat in each plane), as torch;
    the pooling arguments are in ``indices`` already.

    Example:
        >>> g = max_pool2d_backward(jnp.ones((1, 1, 1, 1)), jnp.zeros((1, 1, 2, 2)), 2, 2,
        ...                         0, 1, False, jnp.array([[[[3]]]]))
        >>> g.reshape(-1).tolist()
        [0.0, 0.0, 0.0, 1.0]
    """
    if indices is None:
        indices = pool[-1]
    flat = jnp.zeros((*x.shape[:-2], x.shape[-2] * x.shape[-1]), grad.dtype)
    lead = jnp.indices((*indices.shape[:-2], 1), sparse=True)[:-1]
    at = (*lead, indices.reshape((*indices.shape[:-2], -1)))
    return flat.at[at].add(grad.reshape((*grad.shape[:-2], -1))).reshape(x.shape)


def refused_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops lowered here, for the trace's environment."""
    aten = torch.ops.aten
    return {
        aten.lu_unpack.default: lu_unpack,
        aten.linalg_householder_product.default: householder_product,
        aten.ormqr.default: ormqr,
        aten.segment_reduce.default: segment_reduce,
        aten.max_pool2d_with_indices_backward.default: max_pool2d_backward,
        aten.max_pool2d_with_indices_backward: max_pool2d_backward,  # (op_db calls the packet)
        aten._upsample_bilinear2d_aa.vec: upsample_bilinear2d_aa,
        aten._upsample_bilinear2d_aa.default: upsample_bilinear2d_aa_sized,
        aten._upsample_bilinear2d_aa: upsample_bilinear2d_aa_sized,  # (op_db calls the packet)
    }


def refused_env_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops lowered here that draw from the trace's key (``env``)."""
    return {torch.ops.aten.normal.float_float: normal_float_float}
