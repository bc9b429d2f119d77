"""Pure-Flax twins of the three LightningModules of :mod:`benchmarks._gpu_modules`.

The reference a Flax team would write for each module, same shapes and same math, against
which ``JaxModule.from_lightning(module)`` is measured (``benchmarks/tpu_models.py``):

- ``whisper``: a conv stem (``k=3``, then ``k=3, stride 2``, exact GELU) over log-mel frames
  ``[B, mels, 2 x frames]``, learned positions, pre-norm encoder layers (torch's
  ``nn.TransformerEncoderLayer(norm_first=True)``: one fused ``in_proj``), a final LayerNorm,
  mean pooling and a linear head;
- ``vit``: a ``patch x patch`` conv with stride ``patch``, a class token, learned positions,
  pre-norm blocks, a LayerNorm on the class token, a linear head;
- ``gpt``: nanoGPT's layout: token + learned position embeddings, causal pre-norm blocks,
  ``ln_f`` and the LM head tied to the token embedding.

Every block is LayerNorm (eps 1e-5) -> one ``qkv`` matmul -> ``jaxcore.models.attention.attend``
(``[B, T, N, H]``: XLA, cuDNN or the platform's fused kernel) -> ``proj``, then LayerNorm ->
``fc1`` -> exact (erf) GELU -> ``fc2``, both residual. Params are float32 and the passes compute
in bfloat16 as torch's ``bf16-mixed`` autocast does: matmuls and convs in bfloat16, LayerNorm
statistics, attention softmax and the loss in float32 (the residual stream is bfloat16, the
usual Flax mixed-precision layout and the one ``from_lightning``'s bfloat16 step runs).

:func:`build` gives ``init`` and a ``train_step(state, batch) -> (state, loss)`` (donate the
state when jitting) with ``optax.adamw`` at the module's own ``configure_optimizers`` values
(:func:`adamw_of` reads them off the torch optimizer). Losses: cross entropy, mean over the
batch (ViT: label smoothing 0.1; GPT: mean over tokens). :func:`params_from_state_dict` maps
a module's ``state_dict`` onto a twin's params, for a forward parity check. No torch here.

Run: imported by ``benchmarks/tpu_models.py`` (``python benchmarks/tpu_models.py --dry-run``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcore.models.attention import attend

PyTree = Any
_INIT = nn.initializers.normal(0.02)


def _dense(features: int, name: str, dtype: Any, bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=jnp.float32, name=name)


def _norm(name: str, dtype: Any) -> nn.LayerNorm:
    # statistics and normalisation in float32 (flax upcasts), output in the compute dtype
    return nn.LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32, name=name)


def _gelu(x: jax.Array) -> jax.Array:
    return nn.gelu(x, approximate=False)  # torch's F.gelu default: the erf form


class Block(nn.Module):
    """Pre-norm transformer block: ``x + proj(attn(ln1 x))``, then ``x + fc2(gelu(fc1(ln2 x)))``."""

    heads: int
    mlp: int
    causal: bool = False
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, d] -> [B, T, d]
        b, t, d = x.shape
        qkv = _dense(3 * d, "qkv", self.dtype)(_norm("ln1", self.dtype)(x))
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape) for z in jnp.split(qkv, 3, axis=-1))
        y = attend(q, k, v, is_causal=self.causal).reshape(b, t, d)
        x = x + _dense(d, "proj", self.dtype)(y)
        h = _gelu(_dense(self.mlp, "fc1", self.dtype)(_norm("ln2", self.dtype)(x)))
        return x + _dense(d, "fc2", self.dtype)(h)


class WhisperEncoder(nn.Module):
    """Twin of ``WhisperEncoderClassifier``: ``[B, mels, 2 x frames]`` -> ``[B, classes]``."""

    d: int
    layers: int
    heads: int
    mlp: int
    frames: int
    mels: int
    classes: int = 10
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, mel: jax.Array) -> jax.Array:
        x = jnp.swapaxes(mel, 1, 2).astype(self.dtype)  # NCW -> NWC: [B, 2 x frames, mels]
        for name, stride in (("conv1", 1), ("conv2", 2)):
            conv = nn.Conv(
                self.d, (3,), strides=(stride,), padding=((1, 1),), dtype=self.dtype, name=name
            )
            x = _gelu(conv(x))  # -> [B, frames, d]
        x = x + self.param("pos", _INIT, (self.frames, self.d)).astype(self.dtype)
        for i in range(self.layers):
            x = Block(self.heads, self.mlp, dtype=self.dtype, name=f"blocks_{i}")(x)
        x = _norm("ln", self.dtype)(x).mean(axis=1)
        return _dense(self.classes, "head", self.dtype)(x)


class ViT(nn.Module):
    """Twin of ``ViTClassifier``: ``[B, 3, image, image]`` -> ``[B, classes]``."""

    d: int
    layers: int
    heads: int
    mlp: int
    image: int
    patch: int
    classes: int = 1000
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, image: jax.Array) -> jax.Array:
        p, b = self.patch, image.shape[0]
        x = jnp.transpose(image, (0, 2, 3, 1)).astype(self.dtype)  # NCHW -> NHWC
        x = nn.Conv(
            self.d, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="patch"
        )(x)
        x = x.reshape(b, -1, self.d)  # [B, patches, d], row-major as torch's flatten(2)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.d)).astype(self.dtype)
        pos = self.param("pos", _INIT, (1, x.shape[1] + 1, self.d)).astype(self.dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.d)), x], axis=1) + pos
        for i in range(self.layers):
            x = Block(self.heads, self.mlp, dtype=self.dtype, name=f"blocks_{i}")(x)
        return _dense(self.classes, "head", self.dtype)(_norm("ln", self.dtype)(x[:, 0]))


class GPT(nn.Module):
    """Twin of ``GPT``: ``[B, T]`` token ids -> ``[B, T, vocab]`` logits (LM head tied)."""

    d: int
    layers: int
    heads: int
    vocab: int
    context: int
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, idx: jax.Array) -> jax.Array:
        embed = {"embedding_init": _INIT, "dtype": self.dtype, "param_dtype": jnp.float32}
        wte = nn.Embed(self.vocab, self.d, name="wte", **embed)
        x = wte(idx) + nn.Embed(self.context, self.d, name="wpe", **embed)(jnp.arange(idx.shape[1]))
        for i in range(self.layers):
            x = Block(self.heads, 4 * self.d, causal=True, dtype=self.dtype, name=f"blocks_{i}")(x)
        return wte.attend(_norm("ln_f", self.dtype)(x))  # x @ wte^T in the compute dtype


def make_model(
    name: str, size: Mapping[str, int], classes: int | None = None, dtype: Any = jnp.bfloat16
) -> nn.Module:
    """The twin of model ``name`` ("whisper", "vit", "gpt") at ``size`` (``_gpu_modules.SIZES``).

    Example:
        >>> size = {"d": 32, "layers": 2, "heads": 2, "vocab": 128, "context": 16}
        >>> model = make_model("gpt", size)
        >>> params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
        >>> sorted(params)[:3]
        ['blocks_0', 'blocks_1', 'ln_f']
    """
    extra = {} if classes is None else {"classes": classes}
    if name == "whisper":
        return WhisperEncoder(**size, **extra, dtype=dtype)
    if name == "vit":
        return ViT(**size, **extra, dtype=dtype)
    if name == "gpt":
        return GPT(**size, dtype=dtype)
    raise ValueError(f"model {name!r}: expected one of ['gpt', 'vit', 'whisper']")


def adamw_of(optimizer: Any) -> dict[str, Any]:
    """The ``optax.adamw`` settings of a ``torch.optim.AdamW`` (duck-typed: no torch import).

    One param group, or two where the decayed group holds exactly the params of two or more
    dims (nanoGPT's split: ``decay_matrices_only``). Anything else is refused.
    """
    groups = optimizer.param_groups
    first = groups[0]
    out = {
        "lr": float(first["lr"]),
        "b1": float(first["betas"][0]),
        "b2": float(first["betas"][1]),
        "eps": float(first["eps"]),
        "weight_decay": float(first["weight_decay"]),
        "decay_matrices_only": False,
    }
    same = ("lr", "betas", "eps")
    if len(groups) == 1:
        return out
    decayed = [g for g in groups if g["weight_decay"] > 0]
    rest = [g for g in groups if g["weight_decay"] == 0]
    split = (
        len(groups) == 2
        and len(decayed) == 1
        and all(g[k] == first[k] for g in groups for k in same)
        and all(p.dim() >= 2 for p in decayed[0]["params"])
        and all(p.dim() < 2 for p in rest[0]["params"])
    )
    if not split:
        raise ValueError(
            f"adamw_of: {len(groups)} param groups that are not nanoGPT's decay/no-decay split "
            "by dims; the twin has no mapping for them"
        )
    out["weight_decay"] = float(decayed[0]["weight_decay"])
    out["decay_matrices_only"] = True
    return out


def make_optimizer(
    lr: float, b1: float, b2: float, eps: float, weight_decay: float, decay_matrices_only: bool
) -> optax.GradientTransformation:
    """``optax.adamw`` with torch's AdamW math (decoupled decay, lr x wd x param)."""
    mask = (lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)) if decay_matrices_only else None
    return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)


class Twin(NamedTuple):
    """A twin's model and its pure functions (jit them; donate the state to ``step``)."""

    model: nn.Module
    init: Callable[[jax.Array, jax.Array], PyTree]  # (key, x) -> (params, opt_state)
    step: Callable[[PyTree, Any], tuple[PyTree, jax.Array]]  # (state, (x, y)) -> (state, loss)
    loss: Callable[[PyTree, Any], jax.Array]  # (params, (x, y)) -> loss


def build(
    name: str,
    size: Mapping[str, int],
    adamw: Mapping[str, Any],
    classes: int | None = None,
    dtype: Any = jnp.bfloat16,
) -> Twin:
    """The twin of ``name`` with its loss and an AdamW train step.

    Example:
        >>> size = {"d": 32, "layers": 1, "heads": 2, "vocab": 128, "context": 16}
        >>> opt = {"lr": 3e-4, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1,
        ...        "decay_matrices_only": True}
        >>> twin = build("gpt", size, opt)
        >>> x = jnp.zeros((2, 16), jnp.int32)
        >>> state = twin.init(jax.random.key(0), x)
        >>> state, loss = jax.jit(twin.step, donate_argnums=0)(state, (x, x))
        >>> round(float(loss), 1)  # ln(128)
        4.9
    """
    model = make_model(name, size, classes, dtype)
    tx = make_optimizer(**adamw)
    smoothing = 0.1 if name == "vit" else 0.0

    def loss_fn(params: PyTree, batch: Any) -> jax.Array:
        x, y = batch
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        if smoothing:
            target = optax.smooth_labels(jax.nn.one_hot(y, logits.shape[-1]), smoothing)
            return optax.softmax_cross_entropy(logits, target).mean()
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def init(key: jax.Array, x: jax.Array) -> PyTree:
        params = model.init(key, x[:1])["params"]
        return params, tx.init(params)

    def step(state: PyTree, batch: Any) -> tuple[PyTree, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return Twin(model, init, step, loss_fn)


_RENAMES = (  # torch's nn.TransformerEncoderLayer names -> the twin's Block names
    (r"^encoder\.layers\.", "blocks."),
    (r"self_attn\.in_proj_(weight|bias)$", r"qkv.\1"),
    (r"self_attn\.out_proj\.", "proj."),
    (r"\blinear1\.", "fc1."),
    (r"\blinear2\.", "fc2."),
    (r"\bnorm1\.", "ln1."),
    (r"\bnorm2\.", "ln2."),
)
_EMBEDDINGS = ("wte", "wpe")


def params_from_state_dict(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A twin's params from its torch module's ``state_dict`` (as numpy float32 arrays).

    Linear weights transpose to kernels, conv weights go ``OI[HW] -> [HW]IO``, LayerNorm
    weights become ``scale``, ``nn.Embedding`` weights ``embedding``; the tied ``lm_head`` is
    the token embedding itself.
    """
    params: dict[str, Any] = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        for pattern, repl in _RENAMES:
            key = re.sub(pattern, repl, key)
        *path, leaf = re.sub(r"\.(\d+)\.", r"_\1.", key).split(".")
        value = np.asarray(value, np.float32)
        if leaf == "weight":
            if path and path[-1] in _EMBEDDINGS:
                leaf = "embedding"
            elif value.ndim == 1:
                leaf = "scale"
            else:  # [out, in, *spatial] -> [*spatial, in, out]
                leaf = "kernel"
                value = np.transpose(value, (*range(2, value.ndim), 1, 0))
        node = params
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


__all__ = [
    "GPT",
    "Block",
    "Twin",
    "ViT",
    "WhisperEncoder",
    "adamw_of",
    "build",
    "make_model",
    "make_optimizer",
    "params_from_state_dict",
]
