"""Special functions and solvers torchax 0.0.13 lowers to something else, silently.

torch's own OpInfo database through the trace (issue #52) found:

- ``torch.polygamma(n, x)`` (``torch.special.polygamma``) and the gradient of
  ``torch.digamma`` (``polygamma(1, x)``) wrong at negative ``x``: ``jax.lax.polygamma(1,
  -8.478)`` gives 7.739 where torch and scipy give 9.804 (a JAX bug). Below 1/2 they are
  computed here by the reflection formula ``psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi
  d^n/dx^n cot(pi x)``, whose ``1 - x`` is where JAX's polygamma is right;
- ``torch.special.log_ndtr``: torchax's decomposition gave NaN (value below -20, gradient
  below about -7.9); ``jax.scipy.special.log_ndtr`` is stable both ways;
- ``aten._safe_softmax`` (``F.scaled_dot_product_attention``'s softmax over a fully masked
  row): 0 there as torch, but its gradient was NaN where torch's is 0;
- ``torch.linalg.lstsq``: ``jnp.linalg.lstsq`` (an SVD) gave gradients about 1,000x less
  accurate than torch's in float32 (5.5e-3 on a well-conditioned 3x3); here a QR solve
  (torch's CPU driver ``gelsy`` is a QR), an SVD for ``gelsd``/``gelss``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch


def _cot_derivative(n: int) -> np.ndarray:
    """Coefficients (ascending) of ``Q_n`` with ``d^n/dy^n cot(y) = Q_n(cot(y))``:
    ``Q_0 = c``, ``Q_{k+1} = -(1 + c^2) Q_k'(c)``."""
    q = np.polynomial.Polynomial([0.0, 1.0])
    for _ in range(n):
        q = -(np.polynomial.Polynomial([1.0, 0.0, 1.0]) * q.deriv())
    return q.coef


def _pi_cot_derivative(n: int, x: jax.Array) -> jax.Array:
    """``pi d^n/dx^n cot(pi x)``, with ``x`` first reduced to ``[-1/2, 1/2]`` (exactly:
    ``cot(pi x)`` has period 1) so large ``|x|`` keeps float32's precision."""
    r = x - jnp.round(x)
    c = jnp.cos(jnp.pi * r) / jnp.sin(jnp.pi * r)
    q = jnp.zeros_like(x)
    for coef in _cot_derivative(n)[::-1]:  # Horner
        q = q * c + float(coef)
    return (math.pi ** (n + 1)) * q


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def polygamma(n: int, x: jax.Array) -> jax.Array:
    """``torch.polygamma(n, x)``, right for negative ``x`` too (reflection below 1/2).

    Example:
        >>> round(float(polygamma(1, jnp.float32(-8.478))), 3)  # torch: 9.806
        9.806
    """
    n = int(n)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    if n == 0:
        return jax.scipy.special.digamma(x)
    low = x < 0.5
    mirrored = jnp.where(low, 1 - x, x)  # (> 1/2 both ways: JAX's polygamma is right there)
    direct = jax.lax.polygamma(jnp.asarray(n, x.dtype), mirrored)
    reflected = (-1) ** n * direct - _pi_cot_derivative(n, x)
    return jnp.where(low, reflected, direct)


@polygamma.defjvp
def _polygamma_jvp(n: int, primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
    (x,), (t,) = primals, tangents
    return polygamma(n, x), t * polygamma(n + 1, x)


@jax.custom_jvp
def digamma(x: jax.Array) -> jax.Array:
    """``torch.digamma``: its gradient ``polygamma(1, x)`` right for negative ``x``."""
    return jax.scipy.special.digamma(x)


@digamma.defjvp
def _digamma_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
    (x,), (t,) = primals, tangents
    return digamma(x), t * polygamma(1, x)


def _digamma(x: jax.Array) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return digamma(x)


def log_ndtr(x: jax.Array) -> jax.Array:
    """``torch.special.log_ndtr``: finite value and gradient far into the left tail."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return jax.scipy.special.log_ndtr(x)


def safe_softmax(x: jax.Array, dim: int, dtype: Any = None) -> jax.Array:
    """``aten._safe_softmax``: a softmax whose fully masked rows (all ``-inf``) are 0, with
    gradient 0 there (the row is replaced by zeros before the softmax, not after only)."""
    if dtype is not None:
        from torchax.ops import mappings

        x = x.astype(mappings.t2j_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype)
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    out = jax.nn.softmax(jnp.where(masked, jnp.zeros((), x.dtype), x), axis=dim)
    return jnp.where(masked, jnp.zeros((), out.dtype), out)


def lstsq(
    a: jax.Array, b: jax.Array, rcond: float | None = None, *, driver: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``torch.linalg.lstsq(A, B, rcond, driver)``: ``(solution, residuals, rank,
    singular_values)`` in torch's CPU shapes (``driver=None`` is ``gelsy``).

    ``gelsy``/``gels`` solve by a QR of ``A`` (of ``A^T`` for a wide ``A``: the minimum-norm
    solution), ``gelsd``/``gelss`` by an SVD with torch's ``rcond`` (``eps * max(m, n)``).
    A rank-deficient ``A`` under ``gelsy`` (torch: a pivoted QR's basic solution) is
    computed as the SVD's minimum-norm one.

    Example:
        >>> a = jnp.array([[2.0, 0.5], [0.3, 1.5], [0.1, -0.4]])
        >>> x = lstsq(a, jnp.array([[1.0], [2.0], [0.5]]))[0]
        >>> [round(float(v), 4) for v in x[:, 0]]
        [0.2687, 1.0982]
    """
    driver = driver or "gelsy"
    vector = b.ndim == a.ndim - 1
    if vector:
        b = b[..., None]
    m, n = a.shape[-2], a.shape[-1]
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, (*batch, m, n))
    b = jnp.broadcast_to(b, (*batch, m, b.shape[-1]))
    eps = float(jnp.finfo(a.dtype).eps)
    cut = eps * max(m, n) if rcond is None else float(rcond)
    mT = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    hi = jax.lax.Precision.HIGHEST
    sv = jnp.zeros((0,), a.dtype)
    if driver in ("gelsd", "gelss"):
        u, s, vh = jnp.linalg.svd(a, full_matrices=False)
        keep = s > cut * s[..., :1]
        inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0)
        x = jnp.matmul(mT(vh), inv[..., None] * jnp.matmul(mT(u), b, precision=hi), precision=hi)
        rank = keep.sum(-1).astype(jnp.int32)
        sv = s
    else:
        if m >= n:
            q, r = jnp.linalg.qr(a)
            x = jax.scipy.linalg.solve_triangular(r, jnp.matmul(mT(q), b, precision=hi))
        else:  # the minimum-norm solution: A^T = QR, x = Q R^-T b
            q, r = jnp.linalg.qr(mT(a))
            y = jax.scipy.linalg.solve_triangular(r, b, trans=1)
            x = jnp.matmul(q, y, precision=hi)
        d = jnp.abs(jnp.diagonal(r, axis1=-2, axis2=-1))
        rank = (d > cut * d.max(-1, keepdims=True)).sum(-1).astype(jnp.int32)
        if driver == "gels":
            rank = jnp.zeros((0,), jnp.int32)
    if driver != "gelsy" and m > n:
        residuals = jnp.sum((jnp.matmul(a, x, precision=hi) - b) ** 2, axis=-2)
        if driver != "gels":  # (rank-deficient: torch gives none)
            residuals = jnp.where((rank == n)[..., None], residuals, jnp.nan)
    else:
        residuals = jnp.zeros((0,), a.dtype)
    if vector:
        x = x[..., 0]
    return x, residuals, rank, sv


def special_lowerings() -> dict[Any, Callable[..., Any]]:
    """aten op -> lowering, for :func:`torchshell.trace.environment`."""
    aten = torch.ops.aten
    return {
        aten.polygamma.default: polygamma,
        aten.polygamma: polygamma,  # (torchax's, on the packet, took (x, n): n an array)
        aten.special_polygamma.default: polygamma,
        aten.digamma.default: _digamma,
        aten.special_digamma.default: _digamma,
        aten.special_psi.default: _digamma,
        aten.special_log_ndtr.default: log_ndtr,
        aten._safe_softmax.default: safe_softmax,
        aten.linalg_lstsq.default: lstsq,
        aten.take_along_dim.default: take_along_dim,
        torch.take_along_dim: take_along_dim,  # (torch checks Long before its aten op)
        torch.Tensor.take_along_dim: take_along_dim,
    }


def take_along_dim(x: jax.Array, indices: jax.Array, dim: int | None = None) -> jax.Array:
    """``torch.take_along_dim`` on indices of any integer dtype: a batch field's int64
    indices reach the step as int32 (JAX's x64 off), which torch's own check refused
    ("indices should be Long but got Int"), and ``.long()`` keeps them int32.

    Example:
        >>> take_along_dim(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[1], [0]]), 1).tolist()
        [[2.0], [3.0]]
    """
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        from torchshell._errors import TorchModelError

        raise TorchModelError(
            f"torch.take_along_dim: indices of dtype {indices.dtype}; torch needs integer "
            "indices (it raises 'dtype of indices should be Long'). Fix: pass integer indices."
        )
    if dim is None:
        return jnp.take_along_axis(x.reshape(-1), indices.reshape(-1), axis=0)
    axis = int(dim) % max(x.ndim, 1)
    lead = jnp.broadcast_shapes(
        (*x.shape[:axis], 1, *x.shape[axis + 1 :]),
        (*indices.shape[:axis], 1, *indices.shape[axis + 1 :]),
    )
    x = jnp.broadcast_to(x, (*lead[:axis], x.shape[axis], *lead[axis + 1 :]))
    indices = jnp.broadcast_to(indices, (*lead[:axis], indices.shape[axis], *lead[axis + 1 :]))
    return jnp.take_along_axis(x, indices, axis=axis)
