"""``torch.linalg.eigh`` / ``eigvalsh`` and ``torch.linalg.pinv`` in JAX, as torch computes them
on any input (issue #52).

torch's ``eigh``, ``eigvalsh`` and ``pinv(hermitian=True)`` read one triangle of the input
(``UPLO="L"``, the default, or ``"U"``) and take the matrix as the Hermitian one that triangle
spells; torchax 0.0.13 called ``jnp.linalg.eigh``, which symmetrises ``(A + A^H) / 2``: on a
non-symmetric input (a learned matrix nobody symmetrised) the eigenvalues differed, silently.
torch's gradient is not restricted to the triangle it read: its ``eigh`` backward returns
``V (diag(gL) + skew(V^H gV) / E) V^H``, a full Hermitian matrix, as if the input had been
that Hermitian matrix. :func:`_hermitian` gives both: the triangle's matrix forward, the
Hermitian part of the gradient backward.

torchax's ``linalg_pinv`` also dropped ``atol`` and ``hermitian`` and used JAX's default
cut-off; here it is torch's: singular values (``|eigenvalues|`` when Hermitian) at or below
``max(atol, rtol * largest)`` are dropped, ``rtol`` defaulting to ``eps * max(m, n)`` (0 when a
positive ``atol`` is given), through the same decomposition, so autodiff follows torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshell._errors import TorchModelError

__all__ = ["symmetric_lowerings"]


def _triangle(x: jax.Array, upper: bool) -> jax.Array:
    """The Hermitian matrix one triangle of ``x`` spells (the diagonal's real part)."""
    if upper:
        x = jnp.conj(jnp.swapaxes(x, -1, -2))
    low = jnp.tril(x, -1)
    diagonal = jnp.real(jnp.diagonal(x, axis1=-2, axis2=-1)).astype(x.dtype)
    eye = jnp.eye(x.shape[-1], dtype=bool)
    return jnp.where(eye, diagonal[..., None, :], low + jnp.conj(jnp.swapaxes(low, -1, -2)))


@jax.custom_vjp
def _hermitian_lower(x: jax.Array) -> jax.Array:
    return _triangle(x, upper=False)


@jax.custom_vjp
def _hermitian_upper(x: jax.Array) -> jax.Array:
    return _triangle(x, upper=True)


def _fwd(upper: bool) -> Callable[[jax.Array], tuple[jax.Array, None]]:
    return lambda x: (_triangle(x, upper), None)


def _bwd(_: None, grad: jax.Array) -> tuple[jax.Array]:
    return ((grad + jnp.conj(jnp.swapaxes(grad, -1, -2))) / 2,)


_hermitian_lower.defvjp(_fwd(False), _bwd)
_hermitian_upper.defvjp(_fwd(True), _bwd)


def _hermitian(x: jax.Array, uplo: str) -> jax.Array:
    """``x`` as torch's ``eigh(x, UPLO=uplo)`` reads it (one triangle), with torch's gradient:
    the Hermitian part of the gradient reaches the whole of ``x``."""
    side = str(uplo).upper()
    if side not in ("L", "U"):
        raise TorchModelError(
            f"torch.linalg.eigh(UPLO={uplo!r}): torch takes 'L' or 'U'. Fix: pass UPLO='L' "
            "(the lower triangle, torch's default) or UPLO='U'."
        )
    return _hermitian_upper(x) if side == "U" else _hermitian_lower(x)


def linalg_eigh(a: jax.Array, UPLO: str = "L", compute_v: bool = True) -> Any:
    """``aten._linalg_eigh`` (``torch.linalg.eigh``, ``eigvalsh``): eigenvalues ascending and
    eigenvectors of the Hermitian matrix ``a``'s ``UPLO`` triangle spells.

    Example:
        >>> import torch
        >>> a = torch.tensor([[2.0, 9.0], [1.0, 3.0]])  # (not symmetric: torch reads [2, 1; 1, 3])
        >>> w, _ = linalg_eigh(jnp.asarray(a.numpy()))
        >>> bool(jnp.allclose(w, jnp.asarray(torch.linalg.eigvalsh(a).numpy())))
        True
    """
    w, v = jnp.linalg.eigh(_hermitian(a, UPLO), symmetrize_input=False)
    if not compute_v:  # (torch: an empty tensor)
        return w, jnp.zeros((0,), a.dtype)
    return w, v


def _tolerance(a: jax.Array, atol: Any, rtol: Any, largest: jax.Array) -> jax.Array:
    """torch's cut-off: ``max(atol, rtol * largest)``, ``largest`` of shape ``[..., 1]``."""
    real = jnp.finfo(a.dtype).dtype
    default = jnp.finfo(real).eps * max(a.shape[-2], a.shape[-1])
    zero = jnp.zeros((), real)
    given = jnp.asarray(atol, real) if atol is not None else None
    if rtol is not None:
        relative = jnp.asarray(rtol, real)
    elif given is not None:
        relative = jnp.where(given > 0, zero, jnp.asarray(default, real))
    else:
        relative = jnp.asarray(default, real)
    absolute = given if given is not None else zero
    return jnp.maximum(absolute[..., None], relative[..., None] * largest)


def _mh(x: jax.Array) -> jax.Array:
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _pinv_value(a: jax.Array, atol: Any, rtol: Any, hermitian: bool) -> jax.Array:
    """torch's ``linalg_pinv``: an SVD, or with ``hermitian`` an ``eigh`` of the lower
    triangle; values at or below the cut-off dropped."""
    if hermitian:
        w, v = jnp.linalg.eigh(_triangle(a, upper=False), symmetrize_input=False)
        size = jnp.abs(w)
        tol = _tolerance(a, atol, rtol, jnp.max(size, axis=-1, keepdims=True))
        kept = size > tol
        inverse = jnp.where(kept, 1 / jnp.where(kept, w, 1), 0).astype(a.dtype)
        return jnp.matmul(v * inverse[..., None, :], _mh(v))
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    tol = _tolerance(a, atol, rtol, s[..., :1])
    kept = s > tol
    inverse = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0).astype(a.dtype)
    return jnp.matmul(_mh(vh) * inverse[..., None, :], _mh(u))


@jax.custom_vjp
def _pinv_gradient(a: jax.Array, pinv: jax.Array) -> jax.Array:
    """``pinv`` (of ``a``), differentiated as torch differentiates ``linalg_pinv``."""
    return pinv


def _pinv_fwd(a: jax.Array, pinv: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return pinv, (a, pinv)


def _pinv_bwd(saved: tuple[jax.Array, jax.Array], grad: jax.Array) -> tuple[jax.Array, ...]:
    """torch's ``pinv_backward(grad, pinvA, A)`` (``FunctionsManual.cpp``): the derivative of
    the pseudo-inverse at constant rank, with ``A`` the input as given (every entry)."""
    a, p = saved
    ph, gh = _mh(p), _mh(grad)
    if a.shape[-2] <= a.shape[-1]:
        k = gh @ p
        kph = k @ ph
        g = -_mh(p @ k) + kph - (a @ p) @ kph + (ph @ p) @ (gh - k @ a)
    else:
        k = p @ gh
        phk = ph @ k
        g = -_mh(k @ p) + (gh - a @ k) @ p @ ph + phk - phk @ p @ a
    return g, jnp.zeros_like(p)


_pinv_gradient.defvjp(_pinv_fwd, _pinv_bwd)


def linalg_pinv(
    a: jax.Array,
    *,
    atol: Any = None,
    rtol: Any = None,
    hermitian: bool = False,
) -> jax.Array:
    """``aten.linalg_pinv.atol_rtol_tensor`` (``torch.linalg.pinv``, ``torch.pinverse``) as
    torch computes and differentiates it.

    Example:
        >>> import torch
        >>> a = torch.tensor([[2.0, 0.0], [0.0, 1e-3]])
        >>> want = torch.linalg.pinv(a, atol=0.01)  # (the small singular value dropped)
        >>> got = linalg_pinv(jnp.asarray(a.numpy()), atol=jnp.asarray(0.01))
        >>> bool(jnp.allclose(got, jnp.asarray(want.numpy())))
        True
    """
    m, n = a.shape[-2], a.shape[-1]
    if m == 0 or n == 0:
        return jnp.zeros((*a.shape[:-2], n, m), a.dtype)
    value = _pinv_value(a, atol, rtol, hermitian)
    return _pinv_gradient(a, jax.lax.stop_gradient(value))


def pinv_function(
    a: jax.Array,
    rcond: Any = None,
    hermitian: bool = False,
    *,
    atol: Any = None,
    rtol: Any = None,
) -> jax.Array:
    """``torch.linalg.pinv(A, *, atol, rtol, hermitian)`` (and its older ``rcond``): taken
    whole, so that a float tolerance does not become a float64 tensor (a JAX warning)."""
    if rcond is not None:  # (torch: the tolerance relative to the largest singular value)
        atol, rtol = 0.0, rcond
    return linalg_pinv(a, atol=atol, rtol=rtol, hermitian=hermitian)


def pinverse(a: jax.Array, rcond: float = 1e-15) -> jax.Array:
    """``torch.pinverse(a, rcond)`` / ``a.pinverse(rcond)``."""
    return linalg_pinv(a, atol=0.0, rtol=rcond)


def symmetric_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops above, for the trace's environment (:mod:`._env`)."""
    return {
        torch.ops.aten._linalg_eigh: linalg_eigh,  # (the packet: torchax's lowering's key)
        torch.ops.aten._linalg_eigh.default: linalg_eigh,
        torch.ops.aten.linalg_pinv.atol_rtol_tensor: linalg_pinv,
        torch.linalg.pinv: pinv_function,
        torch.pinverse: pinverse,
        torch.Tensor.pinverse: pinverse,
    }
