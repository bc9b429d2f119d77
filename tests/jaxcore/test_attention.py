"""jaxcore.models.attention.attend, and the spoken-digits encoder's attention built on it."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.models import attention
from jaxcore.models.attention import attend, implementation_for
from jaxcore.models.spoken_digits import Attention, SpokenDigitsEncoder

_NEG = float(jnp.finfo(jnp.float32).min)  # the encoder's masked logit before attend


def _reference(q, k, v, bias=None, mask=None, causal=False, scale=None):
    """Plain math: einsum, masked logits at float32's min, softmax, einsum ([B, T, N, H])."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + bias
    keep = jnp.ones(logits.shape, bool) if mask is None else jnp.broadcast_to(mask, logits.shape)
    if causal:
        keep = keep & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    probs = jax.nn.softmax(jnp.where(keep, logits, _NEG), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _qkv(kv_heads: int = 4, t: int = 6, s: int = 6, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, t, 4, 8), dtype)
    k = jax.random.normal(ks[1], (2, s, kv_heads, 8), dtype)
    v = jax.random.normal(ks[2], (2, s, kv_heads, 8), dtype)
    return q, k, v


@pytest.mark.parametrize("case", ["plain", "mask", "bias", "causal", "scale", "gqa", "cross"])
def test_attend_values_and_grads_equal_the_plain_math(case: str) -> None:
    q, k, v = _qkv(kv_heads=2 if case == "gqa" else 4, s=9 if case == "cross" else 6)
    s = k.shape[1]
    kw: dict = {}
    if case in ("mask", "cross"):
        kw["mask"] = (jnp.arange(s) < jnp.array([s, 3])[:, None])[:, None, None, :]
    if case == "bias":
        kw["bias"] = jax.random.normal(jax.random.key(3), (1, 4, 6, s))
    if case == "causal":
        kw["causal"] = True
    if case == "scale":
        kw["scale"] = 0.3
    ours_kw = {("is_causal" if n == "causal" else n): x for n, x in kw.items()}

    def loss(fn, q, k, v, **kws):
        return jnp.sum(fn(q, k, v, **kws) * jnp.cos(jnp.arange(8)))

    np.testing.assert_allclose(attend(q, k, v, **ours_kw), _reference(q, k, v, **kw), atol=1e-5)
    got = jax.grad(lambda *a: loss(attend, *a, **ours_kw), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(_reference, *a, **kw), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_a_row_with_every_key_masked_averages_the_values_and_is_not_nan() -> None:
    q, k, v = _qkv()
    mask = jnp.array([True, False])[:, None, None, None] & jnp.ones((1, 1, 1, 6), bool)
    out = attend(q, k, v, mask=mask)
    grads = jax.grad(lambda q: jnp.sum(attend(q, k, v, mask=mask)))(q)
    assert not jnp.isnan(out).any() and not jnp.isnan(grads).any()
    np.testing.assert_allclose(out[1], jnp.broadcast_to(v[1].mean(0), (6, 4, 8)), atol=1e-6)


def test_bfloat16_stays_bfloat16_within_its_precision() -> None:
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out = attend(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


def test_the_implementation_is_picked_and_cudnn_refusals_fall_back_to_xla(monkeypatch) -> None:
    q, k, v = _qkv(dtype=jnp.bfloat16)
    assert implementation_for(q) == "xla"  # CPU
    asked = []
    real = jax.nn.dot_product_attention

    def counting(*a, **kw):
        asked.append(kw["implementation"])
        return real(*a, **kw)

    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", counting)
    monkeypatch.setattr(attention, "implementation_for", lambda query: "cudnn")
    mask = jnp.ones((2, 1, 1, 6), bool)
    out = attend(q, k, v, mask=mask)  # cuDNN refuses here (no GPU): XLA
    assert asked == ["cudnn", "xla"]
    np.testing.assert_array_equal(out, real(q, k, v, None, mask, implementation="xla"))
    with pytest.raises(RuntimeError):
        attend(q, k, v, implementation="cudnn")  # asked for by name: no silent fallback
    with pytest.raises(ValueError, match="implementation must be None, 'xla' or 'cudnn'"):
        attend(q, k, v, implementation="flash")


def _old_attention(params, x, mask, heads):
    """The encoder's attention before attend (einsum, float32-min mask, softmax)."""
    b, t, d = x.shape

    def split(name):
        p = params[name]
        return (x @ p["kernel"] + p["bias"]).reshape(b, t, heads, d // heads)

    y = _reference(split("q"), split("k"), split("v"), mask=mask[:, None, None, :])
    return y.reshape(b, t, d) @ params["out"]["kernel"] + params["out"]["bias"]


def test_the_encoder_attention_keeps_its_params_and_its_values() -> None:
    x = jax.random.normal(jax.random.key(0), (3, 7, 32))
    mask = jnp.array([[1] * 7, [1] * 3 + [0] * 4, [0] * 7], bool)  # the last row: all padding
    module = Attention(32, 4)
    params = module.init(jax.random.key(1), x, mask)["params"]
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {n: {"kernel": (32, 32), "bias": (32,)} for n in ("q", "k", "v", "out")}
    out = module.apply({"params": params}, x, mask)
    assert not jnp.isnan(out).any()
    np.testing.assert_allclose(out, _old_attention(params, x, mask, 4), atol=1e-6)
    got = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x, mask) ** 2))(params)
    want = jax.grad(lambda p: jnp.sum(_old_attention(p, x, mask, 4) ** 2))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_encoder_calls_the_fused_attention_once_per_block(monkeypatch) -> None:
    calls = []
    real = jax.nn.dot_product_attention

    def counting(*a, **kw):
        calls.append(kw["implementation"])
        return real(*a, **kw)

    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", counting)
    model = SpokenDigitsEncoder(width=32, depth=3, heads=2)
    feats, mask = jnp.ones((2, 24, 8)), jnp.arange(24) < jnp.array([24, 10])[:, None]
    variables = model.init(jax.random.key(0), feats, mask)
    calls.clear()
    jax.make_jaxpr(lambda v: model.apply(v, feats, mask))(variables)
    assert calls == ["xla"] * 3
    assert isinstance(model, nn.Module)
