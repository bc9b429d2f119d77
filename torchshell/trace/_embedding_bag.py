"""``nn.EmbeddingBag`` / ``F.embedding_bag`` with offsets that are traced batch values.

The PyTorch text-classification tutorial feeds ``EmbeddingBag(text, offsets)`` with the
batch's texts concatenated and each row's start offset. torchax 0.0.13 lowers
``aten::_embedding_bag`` with a Python loop over ``np.array(offsets)``: in a compiled step the
offsets are traced, and the step stopped ("reads the value of one of its arguments in
Python"). Here each index finds its bag with ``searchsorted`` and the bags reduce with
segment sums/maxima: one program for any offsets of the same shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from torchshell._errors import TorchModelError


def embedding_bag(
    weight: jax.Array,
    indices: jax.Array,
    offsets: jax.Array | None = None,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: jax.Array | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """torch's ``aten::_embedding_bag`` (and ``_embedding_bag_forward_only``) in JAX.

    ``mode``: 0 sum, 1 mean, 2 max. An empty bag gives zeros, as in torch; entries equal to
    ``padding_idx`` take no part (nor count in a mean). Returns ``(output, offset2bag,
    bag_size, max_indices)``; torch's backward reads the last three, JAX's does not.

    Example:
        >>> w = jnp.arange(12.0).reshape(4, 3)
        >>> out, *_ = embedding_bag(w, jnp.array([0, 1, 3]), jnp.array([0, 2]), mode=1)
        >>> out.tolist()
        [[1.5, 2.5, 3.5], [9.0, 10.0, 11.0]]
    """
    if scale_grad_by_freq:
        raise TorchModelError(
            "EmbeddingBag(scale_grad_by_freq=True) scales torch's sparse gradient by each "
            "index's count in the batch, which the traced step's gradient does not do. "
            "Expected scale_grad_by_freq=False. Fix: drop it (or scale the loss yourself)."
        )
    if indices.ndim == 2:  # fixed-length bags, one per row
        bags, length = indices.shape
        bag = jnp.repeat(jnp.arange(bags), length)
        indices = indices.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    else:
        if offsets is None:
            raise TorchModelError(
                "EmbeddingBag on 1-D input needs offsets (each bag's start). Fix: pass "
                "offsets, or a 2-D input of fixed-length bags."
            )
        bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
        bag = jnp.searchsorted(offsets, jnp.arange(indices.shape[0]), side="right") - 1
        if include_last_offset:  # past the last offset: in no bag (dropped below)
            bag = jnp.where(jnp.arange(indices.shape[0]) < offsets[-1], bag, bags)
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    valid = valid & (bag >= 0) & (bag < bags)
    bag = jnp.where(valid, bag, bags)  # out of range segments are dropped
    rows = jnp.take(weight, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), bag, bags)
    if mode == 2:
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        out = jax.ops.segment_max(masked, bag, bags)
        out = jnp.where(count[:, None] > 0, out, 0).astype(weight.dtype)
        max_indices = jnp.zeros(out.shape, jnp.int32)
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, bags)
        if mode == 1:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        max_indices = jnp.zeros((bags,), jnp.int32)
    return out, bag.astype(jnp.int32), count, max_indices


def embedding_bag_lowerings() -> dict[Any, Any]:
    """The aten ops (a module's forward under no_grad runs the forward-only one)."""
    import torch

    return {
        torch.ops.aten._embedding_bag.default: embedding_bag,
        torch.ops.aten._embedding_bag_forward_only.default: embedding_bag,
    }
