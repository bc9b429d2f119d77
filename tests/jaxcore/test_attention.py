"""jaxcore.models.attention.attend, and the spoken-digits encoder's attention built on it."""

from __future__ import annotations

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.models import _tpu_attention, attention
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
    with pytest.raises(ValueError, match="implementation must be None, 'xla', 'cudnn', 'splash'"):
        attend(q, k, v, implementation="mosaic")


_PALLAS_CASES = {  # name: (dtype, T, S, kv heads, H, attend's keywords beside q, k, v)
    "float32-padded-key-mask": (jnp.float32, 40, 40, 2, 32, {"mask": "keys"}),
    "bfloat16-causal-mask-per-head": (jnp.bfloat16, 130, 130, 2, 64, {"mask": "heads"}),
    "float32-causal-grouped-query-cross": (jnp.float32, 40, 150, 1, 32, {"scale": 0.3}),
    "bfloat16-causal": (jnp.bfloat16, 70, 70, 2, 32, {}),
}
_SPLASH_CASES = {  # splash's masks: padded keys (computed in the kernel), full, causal
    **_PALLAS_CASES,
    "float32-full-padded": (jnp.float32, 150, 150, 2, 32, {}),
    "bfloat16-full-one-block": (jnp.bfloat16, 128, 128, 1, 64, {}),
    "float32-causal-one-block-key-mask": (jnp.float32, 128, 128, 2, 32, {"mask": "keys"}),
}


@pytest.mark.parametrize(
    ("kernel", "case"),
    [("pallas", c) for c in _PALLAS_CASES] + [("splash", c) for c in _SPLASH_CASES],
)
def test_the_pallas_kernels_interpreted_equal_xla_in_values_and_grads(
    kernel: str, case: str
) -> None:
    dtype, t, s, kv_heads, h, kw = _SPLASH_CASES[case]
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (2, t, 2, h), dtype)
    k, v = (jax.random.normal(x, (2, s, kv_heads, h), dtype) for x in ks[1:3])
    if kw.get("mask") == "keys":  # the second row: every key masked
        kw = {**kw, "mask": (jnp.arange(s) < jnp.array([s - 7, 0])[:, None])[:, None, None, :]}
    elif kw.get("mask") == "heads":
        kw = {**kw, "mask": jax.random.bernoulli(ks[3], 0.6, (2, 2, 1, s))}
    kw = {**kw, "is_causal": "causal" in case}
    weights = jnp.cos(jnp.arange(h))

    def run(implementation, q, k, v):
        out = attend(q, k, v, implementation=implementation, interpret=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    grad = jax.value_and_grad(run, argnums=(1, 2, 3), has_aux=True)
    (_, got), got_grads = grad(kernel, q, k, v)
    (_, want), want_grads = grad("xla", q, k, v)
    assert got.dtype == dtype and got.shape == q.shape
    rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-5  # of each array's largest magnitude
    for g, w in zip((got, *got_grads), (want, *want_grads), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=rtol * float(np.abs(w).max()))


@pytest.mark.parametrize("variant", [{"fused_backward": False}, {"block": 256}])
def test_the_splash_variants_benchmarks_try_equal_xla_too(variant: dict) -> None:
    """Two backward kernels (dq apart from dk, dv; the default fuses them) and a block
    other than its own."""
    ks = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(x, (1, 150, 2, 32)) for x in ks)
    mask = (jnp.arange(150) < 120)[None, None, None, :]
    weights = jnp.cos(jnp.arange(32))

    def splash(q, k, v):
        return _tpu_attention.splash(q, k, v, mask, True, None, True, **variant)

    def xla(q, k, v):
        return attend(q, k, v, mask=mask, is_causal=True, implementation="xla")

    got, want = (
        jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=(0, 1, 2))(q, k, v)
        for f in (splash, xla)
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_splash_is_picked_on_a_tpu_flash_by_name_and_refusals_fall_back_to_xla(
    monkeypatch,
) -> None:
    q, k, v = _qkv()
    picked = []
    for name in ("splash", "flash"):  # each records its call and returns the query
        fake = functools.partial(lambda n, *a: picked.append(n) or a[0], name)
        monkeypatch.setattr(_tpu_attention, name, fake)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "tpu")
    assert implementation_for(q) == "splash"
    assert implementation_for(q.astype(jnp.float16)) == "xla"
    long = jnp.ones((1, attention._PALLAS_MIN_LENGTH, 1, 8))
    assert attend(long, long, long) is long and picked == ["splash"]  # long enough: splash
    attend(q, k, v)  # short: XLA is faster there
    attend(long, long, long, bias=jnp.zeros((1, 1, 1, long.shape[1])))  # a bias: XLA
    assert picked == ["splash"]
    for name in ("splash", "flash", "pallas"):  # short, but asked for by name
        assert attend(q, k, v, implementation=name) is q
    assert picked == ["splash", "splash", "flash", "flash"]
    causal = jnp.tril(jnp.ones((6, 6), bool))[None, None]
    for kw, why in [
        ({"bias": jnp.zeros((1, 1, 6, 6))}, "a bias"),
        ({"mask": causal}, "a mask of shape"),
        ({"value": jnp.ones((2, 6, 4, 16))}, "a value head dim 16"),
    ]:
        for name, kernel in [("splash", "splash attention"), ("pallas", "flash")]:
            with pytest.raises(ValueError, match=f"Pallas {kernel} kernel cannot take {why}"):
                attend(q, k, kw.get("value", v), implementation=name, **_without(kw, "value"))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot take the cpu backend"):
        attend(q, k, v, implementation="splash")


def _without(kw: dict, name: str) -> dict:
    return {n: x for n, x in kw.items() if n != name}


@pytest.mark.parametrize("kernel", ["pallas", "splash"])
@pytest.mark.parametrize(("dtype", "want"), [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")])
def test_the_pallas_kernels_are_traced_at_a_precision_mosaic_takes(
    kernel: str, dtype, want: str
) -> None:
    """Mosaic takes DEFAULT or HIGHEST, bfloat16 only at DEFAULT: under a caller's 'highest',
    forward and backward kernels (the backward traced after attend returned) keep to that."""
    q = jnp.ones((1, 40, 1, 32), dtype)

    def loss(q):
        out = attend(q, q, q, implementation=kernel, interpret=True)
        return jnp.sum(out.astype(jnp.float32))

    with jax.default_matmul_precision("highest"):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(q))
    # forward, dk/dv, dq (splash: forward, and one fused backward kernel for dq, dk and dv)
    assert jaxpr.count("pallas_call") == (2 if kernel == "splash" else 3)
    assert set(re.findall(r"precision=\(Precision\.(\w+)", jaxpr)) == {want}


def test_the_flash_block_is_the_whole_length_up_to_1024_then_the_least_padding() -> None:
    lengths = (40, 130, 640, 1024, 1025, 1152, 1500, 2048, 3000)
    assert [_tpu_attention.flash_block(n) for n in lengths] == [
        (128, 128), (256, 256), (640, 640), (1024, 1024), (640, 1280), (640, 1280),
        (768, 1536), (1024, 2048), (1024, 3072),
    ]  # fmt: skip


def test_the_splash_block_is_the_whole_length_up_to_512_then_the_least_padding() -> None:
    lengths = (40, 197, 512, 513, 1024, 1152, 1280, 1500)
    assert [_tpu_attention.splash_block(n) for n in lengths] == [
        (128, 128), (256, 256), (512, 512), (384, 768), (512, 1024), (384, 1152),
        (256, 1280), (512, 1536),
    ]  # fmt: skip
    assert _tpu_attention.splash_block(1500, 256) == (256, 1536)
    with pytest.raises(ValueError, match="multiple of 128, got 100"):
        _tpu_attention.splash_block(1500, 100)


def test_splash_skips_the_blocks_its_mask_rules_out_whole() -> None:
    """Causal: the blocks above the diagonal; padded keys: a block of padding only. The flash
    kernel (segment ids for the padding) visits every key block."""

    def visited(t: int, keys: int, causal: bool) -> int:
        kernel = _tpu_attention._splash_kernel(1, t, t, keys, causal, 128, 128, False, True)
        return int(np.count_nonzero(np.asarray(kernel.fwd_mask_info.block_mask)))

    assert visited(512, 512, False) == 16
    assert visited(512, 512, True) == 10  # 4 x 4 blocks, 6 above the diagonal
    assert visited(512, 300, False) == 12  # keys 384-511 all padding: a column of 4 skipped


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


def test_one_splash_kernel_serves_two_jitted_functions() -> None:
    """The kernel is cached per shape; its mask's arrays are made eagerly, so a second jitted
    function taking it gets constants, not the first trace's tracers (on the v5e the second
    trace raised UnexpectedTracerError, or ran with a stale input count)."""
    q = jnp.ones((1, 130, 2, 32))

    def f(q):
        return attend(q, q, q, is_causal=True, implementation="splash", interpret=True)

    first = jax.jit(f)(q)
    second = jax.jit(lambda q: 2.0 * f(q))(q)
    np.testing.assert_allclose(second, 2.0 * first, rtol=1e-6)
