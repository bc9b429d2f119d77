"""Per-example losses and exact masked means.

Loss functions return per-example values ``(loss[B], {name: metric[B]})``; the steps reduce
them with the batch ``mask`` so padded rows never count.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

from jaxcore._errors import BatchError


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Mean of ``values[B]`` over rows where ``mask[B]`` is true (all rows when ``None``).

    Example:
        >>> import jax.numpy as jnp
        >>> float(masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
        2.0
    """
    if mask is None:
        return jnp.mean(values)
    m = mask.astype(values.dtype)
    return jnp.sum(values * m) / jnp.maximum(jnp.sum(m), 1)


def _labels(logits: jax.Array, batch: Mapping[str, jax.Array], key: str) -> jax.Array:
    """The integer labels ``[B]`` under ``key``, checked against the logits (at trace time)."""
    fix = (
        f"Fix: give the batch integer class indices of shape [B] under {key!r} (int32 in "
        "the Dataset), or pass label_key= to the loss."
    )
    if key not in batch:
        raise BatchError(
            f"The loss reads labels {key!r}: expected an integer [B] field, got a "
            f"batch with keys {sorted(batch)}. {fix}"
        )
    labels = batch[key]
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise BatchError(
            f"Labels {key!r}: expected an integer [B] array, got {labels.dtype} "
            f"of shape {tuple(labels.shape)}. {fix}"
        )
    if labels.shape != logits.shape[:-1]:
        raise BatchError(
            f"Labels {key!r}: expected an integer [B] array matching logits "
            f"{tuple(logits.shape)} ([B, C]), got shape {tuple(labels.shape)}. "
            f"{fix}"
        )
    return labels


def softmax_cross_entropy(
    logits: jax.Array, batch: Mapping[str, jax.Array], label_key: str = "y"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example cross entropy on integer labels, with accuracy as a metric.

    Args:
        logits: ``[B, C]`` float logits.
        batch: holds integer labels ``[B]`` under ``label_key``.
        label_key: the labels' key.

    Returns:
        ``(loss[B], {"accuracy": [B]})`` in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> loss, m = softmax_cross_entropy(jnp.array([[0.0, 9.0]]), {"y": jnp.array([1])})
        >>> float(m["accuracy"][0])
        1.0
    """
    labels = _labels(logits, batch, label_key)
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"accuracy": accuracy}
