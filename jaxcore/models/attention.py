"""Dot-product attention as one call: cuDNN's fused kernel on a CUDA GPU where it applies, XLA
elsewhere.

``jax.nn.dot_product_attention`` (jax 0.10.2) takes ``implementation=None`` to mean XLA on
every backend (its own note: "defaults to XLA for now"): a GPU gets the fused kernel only when
``implementation="cudnn"`` is asked for, and that raises where cuDNN does not apply
(float32, a head dim over 128/256 or not a multiple of 8, no cuDNN). :func:`attend` asks for
cuDNN on a GPU with bfloat16/float16 inputs and takes XLA where cuDNN refuses, so a caller
never picks by hand. The recipes' Flax encoder and the lowering of torch's
``F.scaled_dot_product_attention`` / ``nn.MultiheadAttention`` in a traced torch module
(``torchshell.trace``) both call it.

Masked logits are set to a large finite negative (``-0.7 * finfo.max``), not ``-inf``: a query
row whose keys are all masked averages the values uniformly instead of giving NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attend", "implementation_for"]

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def implementation_for(query: jax.Array) -> str:
    """``"cudnn"`` where the fused kernel may apply (a GPU, bfloat16/float16), else ``"xla"``.

    Example:
        >>> implementation_for(jnp.ones((1, 4, 2, 8), jnp.bfloat16))  # on CPU
        'xla'
    """
    if jax.default_backend() == "gpu" and query.dtype in _CUDNN_DTYPES:
        return "cudnn"
    return "xla"


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``softmax(q k^T * scale + bias, masked) v`` per head, in ``[B, T, N, H]`` layout.

    Args:
        query: ``[B, T, N, H]``.
        key: ``[B, S, K, H]``; ``K`` divides ``N`` (grouped-query attention when ``K < N``).
        value: ``[B, S, K, H]``.
        bias: additive logits bias, 4-D, broadcastable to ``[B, N, T, S]``.
        mask: boolean, ``True`` where a key takes part, 4-D, broadcastable to ``[B, N, T, S]``.
        is_causal: query ``t`` sees keys ``<= t`` (top-left aligned, as torch).
        scale: logits scale; ``1 / sqrt(H)`` when ``None``.
        implementation: ``"xla"`` or ``"cudnn"``; ``None`` picks (:func:`implementation_for`),
            falling back to XLA where cuDNN refuses the shapes.

    Returns:
        ``[B, T, N, H]`` in the inputs' dtype (logits and softmax computed in float32).

    Example:
        >>> q = jnp.ones((2, 5, 4, 8))
        >>> mask = jnp.array([[True] * 3 + [False] * 2, [True] * 5])[:, None, None, :]
        >>> attend(q, q, q, mask=mask).shape
        (2, 5, 4, 8)
    """
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(
            f"attend: implementation must be None, 'xla' or 'cudnn', got {implementation!r}. "
            "Fix: leave it None to use cuDNN's fused kernel where it applies."
        )
    chosen = implementation or implementation_for(query)
    if chosen == "cudnn":
        t, s = query.shape[1], key.shape[1]
        try:  # cuDNN reads a bias or mask of the full [.., T, S]: broadcast the query axis
            return jax.nn.dot_product_attention(
                query,
                key,
                value,
                None if bias is None else _full(bias, t, s).astype(query.dtype),
                None if mask is None else _full(mask, t, s),
                scale=scale,
                is_causal=is_causal,
                implementation="cudnn",
            )
        except (NotImplementedError, ValueError, RuntimeError):
            if implementation == "cudnn":
                raise
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, implementation="xla"
    )


def _full(x: jax.Array, t: int, s: int) -> jax.Array:
    """A 4-D bias or mask with its last two axes broadcast to ``[t, s]``."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return jnp.broadcast_to(x, (*x.shape[:2], t, s))
