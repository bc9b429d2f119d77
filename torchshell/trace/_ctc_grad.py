"""``aten::_ctc_loss`` with the gradient torch's kernel gives (``F.ctc_loss``, ``nn.CTCLoss``).

torch's CTC kernel does not return the derivative of its loss: its backward
(``ctc_loss_backward_cpu``) gives ``exp(log_probs) - posterior`` on each sequence's frames,
the derivative plus ``exp(log_probs)``. Through a ``log_softmax`` the extra term cancels; fed
anything else (raw logits, a model that forgot its ``log_softmax``), torch trains as if the
input were normalised, and the true derivative that :func:`._ctc.ctc_nll` alone had (JAX's)
moved the weights otherwise, silently (torch's op database found it: ``make opinfo``). Here
the values are :func:`._ctc.ctc_nll`'s and the gradient torch's: JAX's derivative plus
``exp(log_probs)`` times the sequence's incoming gradient, on its first ``input_length``
frames.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from torchshell.trace._ctc import ctc_nll

__all__ = ["ctc_nll_torch_grad"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ctc(
    lp: jax.Array, targets: jax.Array, xl: jax.Array, yl: jax.Array, blank: int, zero: bool
) -> tuple[jax.Array, jax.Array]:
    return ctc_nll(lp, targets, xl, yl, blank, zero)


def _ctc_fwd(
    lp: jax.Array, targets: jax.Array, xl: jax.Array, yl: jax.Array, blank: int, zero: bool
) -> tuple[tuple[jax.Array, jax.Array], Any]:
    out, vjp = jax.vjp(lambda a: ctc_nll(a, targets, xl, yl, blank, zero), lp)
    return out, (vjp, lp, xl)


def _ctc_bwd(blank: int, zero: bool, saved: Any, g: Any) -> tuple[jax.Array, None, None, None]:
    vjp, lp, xl = saved
    g_nll, g_alpha = g
    (grad,) = vjp((g_nll, jnp.zeros_like(g_alpha)))  # (log alpha: not differentiated)
    frames = jnp.arange(lp.shape[0])[:, None] < xl.reshape(1, -1)  # [T, N]
    per_row = g_nll.reshape(1, -1)
    if lp.ndim == 2:  # (unbatched [T, C])
        frames, per_row = frames[:, :1], per_row[:, :1]
    extra = jnp.where(frames[..., None], per_row[..., None] * jnp.exp(lp), 0.0)
    return grad + extra.astype(grad.dtype), None, None, None


_ctc.defvjp(_ctc_fwd, _ctc_bwd)


def ctc_nll_torch_grad(
    log_probs: jax.Array,
    targets: jax.Array,
    input_lengths: Any,
    target_lengths: Any,
    blank: int = 0,
    zero_infinity: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """torch's ``aten::_ctc_loss`` (:func:`._ctc.ctc_nll`) with torch's kernel's gradient.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(6, 1, 4, generator=g, requires_grad=True)  # (not log_softmax'ed)
        >>> F.ctc_loss(x, torch.tensor([[1, 2]]), [6], [2], reduction="sum").backward()
        >>> grad = jax.grad(lambda a: ctc_nll_torch_grad(a, jnp.array([[1, 2]]),
        ...                 jnp.array([6]), jnp.array([2]))[0].sum())(jnp.asarray(x.detach()))
        >>> bool(jnp.allclose(grad, jnp.asarray(x.grad.numpy()), atol=1e-5))
        True
    """
    xl = jnp.asarray(input_lengths, jnp.int32)
    yl = jnp.asarray(target_lengths, jnp.int32)
    return _ctc(log_probs, jnp.asarray(targets), xl, yl, int(blank), bool(zero_infinity))
