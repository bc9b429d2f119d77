"""The spoken-digits recipe's model: a small Whisper-style audio encoder over log-mel frames.

Conv1d stem (GELU, the second conv with stride 2), sinusoidal positions, pre-norm transformer
blocks with masked self-attention, mean-pool over the valid frames, a linear head. Parameter
names follow the torch twin (``stem_0`` <-> ``stem.0``, ``blocks_0/attn/q`` <->
``blocks.0.attn.q``); the conv weights are stored in torch's ``(out, in, width)`` layout, so
the export needs no conv rule.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxcore.models.attention import attend


def sinusoids(length: int, channels: int) -> jax.Array:
    """Whisper's sinusoidal position table ``[length, channels]`` (sin half, then cos half).

    Example:
        >>> sinusoids(4, 8).shape
        (4, 8)
    """
    inc = math.log(10_000) / (channels // 2 - 1)
    inv = jnp.exp(-inc * jnp.arange(channels // 2, dtype=jnp.float32))
    scaled = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=1)


class Conv1d(nn.Module):
    """1-D convolution over ``[B, T, C]`` with a torch-layout ``weight[out, in, width]``."""

    features: int
    width: int = 3
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, C_in] -> [B, T/stride, C_out]
        c_in = x.shape[-1]
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(1, 2))
        weight = self.param("weight", init, (self.features, c_in, self.width))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        pad = self.width // 2
        y = jax.lax.conv_general_dilated(
            x, weight, (self.stride,), [(pad, pad)], dimension_numbers=("NWC", "OIW", "NWC")
        )
        return y + bias


class Attention(nn.Module):
    """Multi-head self-attention with a key mask; projections ``q``, ``k``, ``v``, ``out``.

    The attention itself is :func:`jaxcore.models.attention.attend`
    (``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU where it applies).
    """

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # x: [B, T, D], mask: [B, T]
        b, t, _ = x.shape
        hd = self.width // self.heads

        def split(name: str) -> jax.Array:
            return nn.Dense(self.width, name=name)(x).reshape(b, t, self.heads, hd)

        q, k, v = split("q"), split("k"), split("v")
        # one fused call (cuDNN on a GPU in bf16/fp16, XLA elsewhere); a row whose keys are all
        # masked averages the values uniformly (a large finite negative, never NaN)
        y = attend(q, k, v, mask=mask[:, None, None, :]).reshape(b, t, self.width)
        return nn.Dense(self.width, name="out")(y)


class Block(nn.Module):
    """Pre-norm transformer block: masked attention then a GELU MLP, both residual."""

    width: int
    heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        drop = nn.Dropout(self.dropout, deterministic=not train)
        h = Attention(self.width, self.heads, name="attn")(
            nn.LayerNorm(1e-5, name="norm1")(x), mask
        )
        x = x + drop(h)
        h = nn.Dense(self.width * self.mlp_ratio, name="fc1")(nn.LayerNorm(1e-5, name="norm2")(x))
        h = nn.Dense(self.width, name="fc2")(nn.gelu(h, approximate=False))
        return x + drop(h)


class SpokenDigitsEncoder(nn.Module):
    """Whisper-style encoder classifying log-mel frames into the ten digits.

    Attributes:
        width: model width.
        depth: transformer blocks.
        heads: attention heads.
        mlp_ratio: MLP hidden width over ``width``.
        num_classes: output logits.
        dropout: residual dropout in training.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> m = SpokenDigitsEncoder(width=32, depth=1, heads=2)
        >>> feats, mask = jnp.ones((2, 48, 40)), jnp.ones((2, 48), bool)
        >>> v = m.init(jax.random.key(0), feats, mask)
        >>> m.apply(v, feats, mask).shape
        (2, 10)
    """

    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    num_classes: int = 10
    dropout: float = 0.1

    @nn.compact
    def __call__(
        self, features: jax.Array, frame_mask: jax.Array, train: bool = False
    ) -> jax.Array:  # features: [B, T, n_mels], frame_mask: [B, T] -> [B, num_classes]
        mask = frame_mask.astype(bool)
        x = features * mask[..., None].astype(features.dtype)
        x = nn.gelu(Conv1d(self.width, 3, 1, name="stem_0")(x), approximate=False)
        x = x * mask[..., None].astype(x.dtype)  # padded frames stay zero, as at the edges
        x = nn.gelu(Conv1d(self.width, 3, 2, name="stem_1")(x), approximate=False)
        mask = mask[:, ::2]  # the stride-2 conv's output frame t is centred on input 2t
        x = x + sinusoids(x.shape[1], self.width)[None].astype(x.dtype)
        for i in range(self.depth):
            x = Block(self.width, self.heads, self.mlp_ratio, self.dropout, name=f"blocks_{i}")(
                x, mask, train
            )
        x = nn.LayerNorm(1e-5, name="norm")(x)
        m = mask[..., None].astype(x.dtype)
        pooled = jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        return nn.Dense(self.num_classes, name="head")(pooled)
