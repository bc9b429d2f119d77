"""``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` in a traced step: one
fused attention call (:func:`jaxcore.models.attention.attend`, ``jax.nn.dot_product_attention``:
cuDNN's fused kernel on a GPU in bfloat16/float16, XLA elsewhere), as the recipes' Flax encoder.

torchax 0.0.13 lowers ``scaled_dot_product_attention`` to its own math reference (matmul,
``-inf`` mask, softmax, matmul): never a fused kernel, and ``NaN`` where torch gives 0 (a query
whose keys are all masked). Here :func:`sdpa` maps torch's arguments onto ``attend``:

- ``[..., heads, L, E]`` becomes ``[B, L, heads, E]``; ``enable_gqa`` (fewer key/value heads)
  is JAX's grouped-query attention, with the same head grouping as torch;
- a boolean ``attn_mask`` (``True``: take part) is the mask; a float one is an additive bias,
  its ``-inf`` entries a mask (``nn.MultiheadAttention`` turns ``key_padding_mask`` into
  such a float mask); ``is_causal`` and ``scale=`` are passed on;
- a query row with no key left comes out 0, as torch's kernels give (its ``_safe_softmax``).

``dropout_p > 0`` (attention dropout in training: ``nn.MultiheadAttention(dropout=...)``,
``nn.TransformerEncoderLayer``'s attention) has no fused form in ``jax.nn``: it takes the math
path (:func:`_math`: float32 logits, the same masks, dropout from the step's key scaled by
``1 / (1 - p)``, as torch). So do shapes ``attend`` cannot take (a value head dim unlike the
key's, batch dims of ``q`` and ``k`` that differ).

``nn.MultiheadAttention`` calls ``F.multi_head_attention_forward``, which reaches
``scaled_dot_product_attention`` only with ``need_weights=False`` (what
``nn.TransformerEncoderLayer`` passes); its default, ``need_weights=True``, computes the
weights by hand. :func:`mha_forward` takes the output from the ``need_weights=False`` call
and the weights from torch's own (the compiled step drops that second computation when the
weights are not used, and XLA shares the projections between the two when they are). With
attention dropout in training the weights returned are after dropout, as torch's, so the
output must come from the same draw: torch's own path runs whole.

Self- or cross-attention with no weights asked for, no mask, no attention dropout and packed
projections (``nn.TransformerEncoderLayer`` without padding) skips torch's function: the
projections go straight to ``attend``'s ``[B, L, heads, E]`` layout (:func:`_direct`).
Through torch's function they pass ``[L, B*heads, E]`` views and transposes that XLA on a TPU
turned into copies: 12 ms of a 90 ms Whisper-base encoder step (``benchmarks/tpu_profile.py
encoder-t``).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jaxcore.models.attention import attend

__all__ = ["mha_forward", "sdpa"]

_F_MHA = F.multi_head_attention_forward
_MHA_SIGNATURE = inspect.signature(_F_MHA)


def sdpa(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    attn_mask: jax.Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    env: Any = None,
) -> jax.Array:
    """``F.scaled_dot_product_attention`` on JAX arrays: :func:`attend` where it applies.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> q = torch.randn(2, 4, 5, 8)
        >>> ours = sdpa(*(jnp.asarray(t.numpy()) for t in (q, q, q)), is_causal=True)
        >>> ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> bool(jnp.allclose(ours, jnp.asarray(ref.numpy()), atol=1e-5))
        True
    """
    bias, mask = _bias_and_mask(attn_mask, query.dtype)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    fused = (
        dropout_p == 0.0
        and query.ndim >= 3
        and key.shape == value.shape
        and query.shape[:-3] == key.shape[:-3]
        and query.shape[-1] == key.shape[-1]
        and query.shape[-3] % key.shape[-3] == 0
        and (enable_gqa or query.shape[-3] == key.shape[-3])
    )
    if not fused:
        rng = env.get_and_rotate_prng_key() if dropout_p > 0.0 else None
        return _math(query, key, value, bias, mask, is_causal, scale, dropout_p, rng, enable_gqa)
    lead = query.shape[:-3]
    q, k, v = (_btnh(x) for x in (query, key, value))
    out = attend(
        q,
        k,
        v,
        bias=None if bias is None else _bnts(bias, lead),
        mask=None if mask is None else _bnts(mask, lead),
        is_causal=bool(is_causal),
        scale=scale,
    )
    out = jnp.swapaxes(out, 1, 2).reshape(query.shape)  # [B, L, N, E] -> [..., N, L, E]
    if mask is None:
        return out
    keep = _with_causal(mask, is_causal, query.shape[-2], key.shape[-2])
    return out * jnp.any(keep, axis=-1, keepdims=True).astype(out.dtype)  # no key left: 0


def _bias_and_mask(
    attn_mask: jax.Array | None, dtype: Any
) -> tuple[jax.Array | None, jax.Array | None]:
    """torch's ``attn_mask`` as an additive float bias and a boolean mask (``True``: attend)."""
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == jnp.bool_:
        return None, attn_mask
    keep = attn_mask != -jnp.inf
    return jnp.where(keep, attn_mask, 0).astype(jnp.promote_types(dtype, jnp.float32)), keep


def _btnh(x: jax.Array) -> jax.Array:
    """``[..., N, L, E]`` -> ``[B, L, N, E]`` (the batch dims flattened)."""
    x = x.reshape((-1, *x.shape[-3:]))
    return jnp.swapaxes(x, 1, 2)


def _bnts(m: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """A mask or bias broadcastable to ``[*lead, N, L, S]`` as 4-D ``[B or 1, N or 1, L, S]``."""
    m = m.reshape((1,) * (len(lead) + 3 - m.ndim) + m.shape) if m.ndim < len(lead) + 3 else m
    if all(d == 1 for d in m.shape[: len(lead)]):
        return m.reshape((1, *m.shape[len(lead) :]))
    m = jnp.broadcast_to(m, (*lead, *m.shape[len(lead) :]))
    return m.reshape((-1, *m.shape[len(lead) :]))


def _with_causal(mask: jax.Array, is_causal: bool, length: int, source: int) -> jax.Array:
    """``mask`` and, with ``is_causal``, torch's top-left causal mask ``tril(ones(L, S))``."""
    if not is_causal:
        return mask
    return mask & jnp.tril(jnp.ones((length, source), bool))


def _math(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    rng: jax.Array | None,
    enable_gqa: bool,
) -> jax.Array:
    """torch's math attention: float32 logits and softmax (rows with no key: 0), dropout."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = (jnp.repeat(x, repeats, axis=-3) for x in (key, value))
    logits = jnp.einsum("...le,...se->...ls", query, key, preferred_element_type=jnp.float32)
    logits = logits * scale
    if bias is not None:
        logits = logits + bias
    length, source = query.shape[-2], key.shape[-2]
    keep = _with_causal(jnp.ones((), bool) if mask is None else mask, is_causal, length, source)
    logits = jnp.where(keep, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total == 0, 1.0, total)
    if rng is not None and dropout_p > 0.0:  # sdpa passes a key exactly then
        kept = jax.random.bernoulli(rng, 1.0 - dropout_p, probs.shape)
        probs = jnp.where(kept, probs / (1.0 - dropout_p), 0.0)
    out = jnp.einsum("...ls,...sv->...lv", probs.astype(value.dtype), value)
    return out.astype(query.dtype)


def mha_forward(*args: Any, env: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` whose output always comes through :func:`sdpa`.

    The weights, where asked for, come from torch's own computation (see the module notes).
    torchax runs a function it intercepts with its function mode off, so the
    ``scaled_dot_product_attention`` inside would reach it only as an aten op (the CPU flash
    kernel's decomposition): for the duration of the call, ``F``'s own name for it is
    :func:`sdpa` on the traced arrays.
    """
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if _direct_applies(given):
        return _direct(given, env)

    def fused(*a: Any, **kw: Any) -> Any:
        return env.j2t_iso(sdpa(*env.t2j_iso(a), env=env, **env.t2j_iso(kw)))

    before = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused
    try:
        if not given["need_weights"] or (given["dropout_p"] > 0.0 and given["training"]):
            return _F_MHA(**given)
        output, _ = _F_MHA(**{**given, "need_weights": False})
        _, weights = _F_MHA(**given)
    finally:
        F.scaled_dot_product_attention = before
    return output, weights


def _direct_applies(given: dict[str, Any]) -> bool:
    """Whether :func:`_direct` computes what torch's function would (see the module notes)."""
    return bool(
        not given["need_weights"]
        # (inside the user's own torch.autocast region torch's path runs, under its policy)
        and not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
        and not (given["dropout_p"] > 0.0 and given["training"])
        and not given["use_separate_proj_weight"]
        and given["in_proj_weight"] is not None
        and given["bias_k"] is None
        and given["bias_v"] is None
        and not given["add_zero_attn"]
        and given["static_k"] is None
        and given["static_v"] is None
        and given["attn_mask"] is None
        and given["key_padding_mask"] is None
        and not given["is_causal"]
        and given["query"].dim() == 3
        and given["query"].shape[-1] % given["num_heads"] == 0
    )


def _direct(given: dict[str, Any], env: Any) -> tuple[Any, None]:
    """``F.multi_head_attention_forward`` (seq-first ``[L, B, E]``) as projections into
    :func:`attend`'s layout: one einsum per projection straight to ``[B, L, heads, head dim]``
    (as Flax's ``DenseGeneral``; one packed projection split afterwards cost copies on a TPU)."""
    names = ("query", "key", "value", "in_proj_weight", "in_proj_bias")
    query, key, value, weight, bias = env.t2j_iso(tuple(given[n] for n in names))
    out_w, out_b = env.t2j_iso((given["out_proj_weight"], given["out_proj_bias"]))
    heads = given["num_heads"]
    embed = query.shape[-1]
    weights = weight.reshape(3, heads, embed // heads, embed)  # [q/k/v, head, head dim, E]
    biases = (None,) * 3 if bias is None else bias.reshape(3, heads, -1)

    def project(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
        y = jnp.einsum("lbe,hde->blhd", x, w)  # [L, B, E] -> [B, L, heads, head dim]
        return y if b is None else y + b

    q, k, v = (project(x, weights[i], biases[i]) for i, x in enumerate((query, key, value)))
    out = jnp.einsum("blhd,ehd->lbe", attend(q, k, v), out_w.reshape(embed, heads, -1))
    return env.j2t_iso(out if out_b is None else out + out_b), None
