"""Cholesky factorisation and solve, with torch's gradients.

torch reads one triangle of the matrix it factors and gives it a symmetric (Hermitian)
gradient, as for a function of a symmetric matrix (``cholesky_backward`` in torch's
``FunctionsManual.cpp``); JAX's gradient of the same triangle-reading function is not
symmetric, so a parameter factored directly (``torch.linalg.cholesky(P)``) moved otherwise
than in torch. ``cholesky_solve`` (torchax: ``cho_solve``) gave its factor a gradient in the
triangle it reads only, where torch's formula gives one over the whole matrix, and torchax
transposed every axis of a batched upper factor. Here both are computed with torch's
formulas (torch's op database found them: ``make opinfo``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

__all__ = ["cholesky_lowerings"]


def _mh(x: jax.Array) -> jax.Array:
    return jnp.conj(jnp.swapaxes(x, -1, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _factor(a: jax.Array, upper: bool) -> jax.Array:
    low = jax.lax.linalg.cholesky(_mh(a) if upper else a, symmetrize_input=False)
    return _mh(low) if upper else low


def _factor_fwd(a: jax.Array, upper: bool) -> tuple[jax.Array, Any]:
    out = _factor(a, upper)
    return out, (_mh(out) if upper else out,)


def _factor_bwd(upper: bool, saved: Any, g: jax.Array) -> tuple[jax.Array]:
    """torch's ``cholesky_backward`` (Murray 2016), on the lower factor."""
    (low,) = saved
    g = _mh(g) if upper else g
    phi = jnp.tril(_mh(low) @ g)
    phi = 0.5 * (phi + _mh(jnp.tril(phi, -1)))
    solve = jax.lax.linalg.triangular_solve
    ga = solve(low, phi, left_side=True, lower=True, transpose_a=True, conjugate_a=True)
    ga = solve(low, ga, left_side=False, lower=True)
    return (_mh(ga) if upper else ga,)


_factor.defvjp(_factor_fwd, _factor_bwd)


def cholesky(a: jax.Array, upper: bool = False) -> jax.Array:
    """``torch.cholesky`` / ``torch.linalg.cholesky``: one triangle read, torch's gradient.

    Example:
        >>> import torch
        >>> p = torch.tensor([[4.0, 1.0], [2.0, 3.0]], requires_grad=True)
        >>> torch.linalg.cholesky(p).sum().backward()
        >>> g = jax.grad(lambda a: cholesky(a).sum())(jnp.array([[4.0, 1.0], [2.0, 3.0]]))
        >>> bool(jnp.allclose(g, jnp.asarray(p.grad.numpy())))
        True
    """
    return _factor(a, bool(upper))


def cholesky_ex(
    a: jax.Array, upper: bool = False, check_errors: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``torch.linalg.cholesky_ex``: the factor and ``info`` (0; a matrix that is not
    positive definite gives NaN in the factor, as JAX's factorisation does)."""
    del check_errors  # (a check of traced values cannot stop a compiled step)
    return cholesky(a, upper), jnp.zeros(a.shape[:-2], jnp.int32)


def _solve(b: jax.Array, factor: jax.Array, upper: bool) -> jax.Array:
    """``A^{-1} b`` for ``A = L L^H`` (``U^H U`` when ``upper``), reading that triangle."""
    solve = jax.lax.linalg.triangular_solve
    low = not upper
    y = solve(factor, b, left_side=True, lower=low, transpose_a=upper, conjugate_a=upper)
    return solve(factor, y, left_side=True, lower=low, transpose_a=low, conjugate_a=low)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cholesky_solve(b: jax.Array, factor: jax.Array, upper: bool) -> jax.Array:
    return _solve(b, factor, upper)


def _cholesky_solve_fwd(b: jax.Array, factor: jax.Array, upper: bool) -> tuple[jax.Array, Any]:
    x = _solve(b, factor, upper)
    return x, (factor, x)


def _cholesky_solve_bwd(upper: bool, saved: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """torch's ``cholesky_solve_backward``: the factor's gradient over the whole matrix."""
    factor, x = saved
    grad_b = _solve(g, factor, upper)
    common = grad_b @ _mh(x)
    common = common + _mh(common)
    return grad_b, -(factor @ common if upper else common @ factor)


_cholesky_solve.defvjp(_cholesky_solve_fwd, _cholesky_solve_bwd)


def cholesky_solve(b: jax.Array, factor: jax.Array, upper: bool = False) -> jax.Array:
    """``torch.cholesky_solve(b, factor, upper)``: batch dimensions broadcast, torch's
    gradients.

    Example:
        >>> l = jnp.array([[2.0, 0.0], [1.0, 3.0]])
        >>> x = cholesky_solve(jnp.array([[1.0], [2.0]]), l)
        >>> bool(jnp.allclose(l @ l.T @ x, jnp.array([[1.0], [2.0]]), atol=1e-6))
        True
    """
    batch = jnp.broadcast_shapes(b.shape[:-2], factor.shape[:-2])
    dtype = jnp.result_type(b, factor)
    b = jnp.broadcast_to(b, batch + b.shape[-2:]).astype(dtype)
    factor = jnp.broadcast_to(factor, batch + factor.shape[-2:]).astype(dtype)
    return _cholesky_solve(b, factor, bool(upper))


def cholesky_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops lowered here, for the trace's environment."""
    aten = torch.ops.aten
    return {
        aten.cholesky.default: cholesky,
        aten.linalg_cholesky_ex.default: cholesky_ex,
        aten.cholesky_solve.default: cholesky_solve,
    }
