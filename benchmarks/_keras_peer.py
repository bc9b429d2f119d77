"""Peer (c): Keras 3 on the JAX backend, fed by the same torch DataLoader (through numpy).

Keras picks its backend when first imported, from ``KERAS_BACKEND``: :func:`keras_module`
sets it to ``jax`` and refuses a Keras already imported with another backend. The
benchmark scripts run in their own processes, so this never touches another benchmark.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
from torch.utils.data import default_collate


def keras_module() -> Any:
    """``keras``, imported on the JAX backend."""
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"Keras was already imported with the {keras.backend.backend()!r} backend; this "
            "benchmark needs KERAS_BACKEND=jax. Fix: run it in a fresh process."
        )
    return keras


def keras_mlp() -> Any:
    """The digits MLP, 64-256-256-10 with ReLU."""
    keras = keras_module()
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((64,)),
            layers.Dense(256, activation="relu"),
            layers.Dense(256, activation="relu"),
            layers.Dense(10),
        ]
    )


def _sinusoids(length: int, channels: int) -> np.ndarray:
    inc = math.log(10_000) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def keras_encoder(
    frames: int, mels: int, width: int = 64, depth: int = 2, heads: int = 4, mlp_ratio: int = 4
) -> Any:
    """The spoken-digits encoder in Keras layers (same shapes and FLOPs as the Flax model)."""
    keras = keras_module()
    layers, ops = keras.layers, keras.ops
    feats = keras.Input((frames, mels), name="features")
    fmask = keras.Input((frames,), name="frame_mask", dtype="bool")
    m = ops.expand_dims(ops.cast(fmask, "float32"), -1)
    x = layers.Conv1D(width, 3, padding="same")(feats * m)
    x = ops.gelu(x, approximate=False) * m
    x = ops.gelu(layers.Conv1D(width, 3, strides=2, padding="same")(x), approximate=False)
    mask = fmask[:, ::2]
    t = frames // 2
    x = x + ops.convert_to_tensor(_sinusoids(t, width))[None]
    attn_mask = ops.repeat(ops.expand_dims(mask, 1), t, axis=1)  # [B, T_q, T_k]
    for _ in range(depth):
        y = layers.LayerNormalization(epsilon=1e-5)(x)
        x = x + layers.MultiHeadAttention(heads, width // heads)(y, y, attention_mask=attn_mask)
        y = layers.Dense(width * mlp_ratio)(layers.LayerNormalization(epsilon=1e-5)(x))
        x = x + layers.Dense(width)(ops.gelu(y, approximate=False))
    x = layers.LayerNormalization(epsilon=1e-5)(x)
    m2 = ops.expand_dims(ops.cast(mask, "float32"), -1)
    pooled = ops.sum(x * m2, axis=1) / ops.maximum(ops.sum(m2, axis=1), 1.0)
    return keras.Model({"features": feats, "frame_mask": fmask}, layers.Dense(10)(pooled))


class TupleCollate:
    """Collates dict rows into Keras' ``(x, y)``: one input as a tensor, several as a dict."""

    def __init__(self, inputs: Sequence[str]) -> None:
        self.inputs = tuple(inputs)

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> tuple[Any, torch.Tensor]:
        b = default_collate(items)
        x = b[self.inputs[0]] if len(self.inputs) == 1 else {k: b[k] for k in self.inputs}
        return x, b["y"]


def keras_path(
    model: Any, loader: Any, warmup: int, lr: float = 1e-3
) -> Callable[[int], tuple[float, int]]:
    """``steps -> (seconds, steps timed)`` for ``model.fit`` on ``loader`` (Keras defaults:
    one step per call, async callbacks, no progress bar)."""
    keras = keras_module()
    model.compile(
        optimizer=keras.optimizers.Adam(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    per_epoch = len(loader)

    class Clock(keras.callbacks.Callback):  # type: ignore[misc]
        # Only batch *begin* and train end: Keras keeps its async per-step dispatch.
        def __init__(self) -> None:
            super().__init__()
            self.seen, self.start, self.end = 0, 0.0, 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self.seen == warmup:
                state = getattr(self.model, "_jax_state", None)
                if state:
                    jax.block_until_ready(state)
                self.start = time.perf_counter()
            self.seen += 1

        def on_train_end(self, logs: Any = None) -> None:
            jax.block_until_ready([v.value for v in self.model.variables])
            self.end = time.perf_counter()

    def run(steps: int) -> tuple[float, int]:
        clock = Clock()
        model.fit(  # (shuffle=False: the loader shuffles; Keras would warn it ignores True)
            loader,
            epochs=math.ceil((warmup + steps) / per_epoch),
            verbose=0,
            callbacks=[clock],
            shuffle=False,
        )
        return clock.end - clock.start, clock.seen - warmup

    return run
