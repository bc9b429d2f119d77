"""The digits recipe's model: an MLP over the 8x8 scikit-learn digits (64 features)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """ReLU MLP classifier; layers are named ``layers_i`` and ``head`` (torch twin names).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> m = MLP(features=(16,), num_classes=10)
        >>> v = m.init(jax.random.key(0), jnp.ones((1, 64)))
        >>> m.apply(v, jnp.ones((1, 64))).shape
        (1, 10)
    """

    features: Sequence[int] = (256, 256)
    num_classes: int = 10
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: [B, 64]
        for i, width in enumerate(self.features):
            x = nn.relu(nn.Dense(width, name=f"layers_{i}")(x))
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="head")(x)  # [B, num_classes]
