"""The Pallas TPU attention kernels behind :func:`jaxcore.models.attention.attend`: splash
attention and the flash kernel, on ``[B, T, N, H]`` inputs.

Both take lengths padded to their block and a key-padding mask; both run on the CPU in
Pallas' interpret mode (``interpret=True``: the tests' way in, slow). What they share:

- the lengths are padded up to a multiple of the block, the padded query rows sliced off;
- a query row whose keys are all masked averages the values, as XLA does with its large finite
  negative (the kernels average over whatever keys they visited): :func:`_rows_without_keys`;
- they are traced at the DEFAULT matmul precision (HIGHEST for float32 where the caller set a
  higher default): Mosaic takes no other, and bfloat16 operands only at DEFAULT
  (:func:`_traced_under`, which sets it again for the backward, traced after ``attend``
  returned).

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``, MaxText's) differs from
the flash kernel where the v5e profiles showed the flash kernel's cost: it keeps the softmax
residual as one logsumexp per query row (the flash wrapper broadcasts ``l`` and ``m`` to 128
lanes for its backward: 8-12 ms of a step), and it skips the blocks a mask object rules out
whole (causal: half the blocks; padded keys: whole padded blocks). Its mask is static (a
``_PaddedKeys`` mask computed inside the kernel: causal and the padded keys), a caller's
key-padding mask goes in as segment ids (query rows segment 1, kept keys 1, masked keys 0). It
wants the query scaled beforehand (its logits are ``q k^T``) and ``[heads, T, H]`` per example
(``jax.vmap`` over the batch); grouped-query key/value heads go in as they are.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["flash", "flash_block", "splash", "splash_block"]

FLASH_MAX_BLOCK = 1024
SPLASH_MAX_BLOCK = 512  # MaxText's default block (sa_block_q / sa_block_kv); not tuned here


def flash_block(length: int) -> tuple[int, int]:
    """The flash kernel's block along a sequence of ``length`` and the length padded to it.

    One block of ``length`` rounded up to 128 up to 1024; past it the block of 512 to 1024
    (a multiple of 128) that pads least, the largest of those: on a v5e at ``T = 1500``
    blocks of 768 took 7.6 ms, 512 8.4, 384 10.6, 256 14.1; at 1152, 640 (no padding past
    1280) took 5.7 ms and 512 (1536) 8.2.
    """
    return _least_padding(length, 512, FLASH_MAX_BLOCK)


def splash_block(length: int, block: int | None = None) -> tuple[int, int]:
    """Splash's block along a sequence of ``length`` (``block`` when given, a multiple of 128)
    and the length padded to it: the whole length rounded up to 128 up to 512, past it the
    block of 256 to 512 that pads least, the largest of those (1500: 512 over 1536; 1024: 512;
    1152: 384). Not measured on a chip yet: ``benchmarks/attention_tpu.py --blocks`` does.
    """
    if block is not None:
        if block % 128 or block <= 0:
            raise ValueError(f"splash: block must be a positive multiple of 128, got {block}.")
        return block, -(-length // block) * block
    return _least_padding(length, 256, SPLASH_MAX_BLOCK)


def _least_padding(length: int, smallest: int, largest: int) -> tuple[int, int]:
    whole = -(-length // 128) * 128
    if whole <= largest:
        return whole, whole
    padded = {block: -(-length // block) * block for block in range(smallest, largest + 1, 128)}
    block = min(padded, key=lambda b: (padded[b], -b))
    return block, padded[block]


def splash(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    is_causal: bool,
    scale: Any,
    interpret: bool,
    *,
    block: int | None = None,
    fused_backward: bool = True,
) -> jax.Array:
    """Splash attention on ``[B, T, N, H]`` inputs (see the module notes); ``mask`` a key-padding
    mask ``[B or 1, N or 1, 1, S]`` or ``None``. ``block`` and ``fused_backward=False`` (two
    backward kernels, dq apart from dk and dv) are for benchmarks: on the v5e the fused one
    was 1.14-1.16x faster at block 512 (``benchmarks/attention_tpu.py``, 2026-12-08)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    (b, t, n, h), (s, kv_heads) = query.shape, key.shape[1:3]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    query = (query * scale).astype(query.dtype)  # the kernel's logits are q k^T
    (block_q, tp), (block_k, sp) = splash_block(t, block), splash_block(s, block)
    q, k, v = _layout(query, tp), _layout(key, sp), _layout(value, sp)  # [B, heads, L, H]
    keep = None if mask is None else _keep(mask, b, s)  # [B * heads of the mask, S]
    if mask is not None and mask.shape[1] != 1:  # per head: each (example, head) a call
        if kv_heads != n:
            k, v = (jnp.repeat(x, n // kv_heads, axis=1) for x in (k, v))
        q, k, v = (x.reshape(b * n, 1, *x.shape[2:]) for x in (q, k, v))
    kernel = _splash_kernel(
        q.shape[1], tp, sp, s, is_causal, block_q, block_k, fused_backward, interpret
    )
    segments: tuple[jax.Array, ...] = ()
    if keep is not None:
        kv = jnp.pad(keep.astype(jnp.int32), ((0, 0), (0, sp - s)))
        segments = (jnp.ones((q.shape[0], tp), jnp.int32), kv)

    def call(q: jax.Array, k: jax.Array, v: jax.Array, *seg: jax.Array) -> jax.Array:
        def one(q: jax.Array, k: jax.Array, v: jax.Array, *seg: jax.Array) -> jax.Array:
            return kernel(q, k, v, segment_ids=sk.SegmentIds(*seg) if seg else None)

        return jax.vmap(one)(q, k, v, *seg)

    out = _traced_under(_precision(q.dtype), False, call, q, k, v, *segments)
    out = out.reshape(b, n, tp, h)[:, :, :t].swapaxes(1, 2)  # [B, T, N, H]
    return out if keep is None else _rows_without_keys(out, keep, value, is_causal)


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    heads: int,
    tp: int,
    sp: int,
    keys: int,
    causal: bool,
    block_q: int,
    block_k: int,
    fused_backward: bool,
    interpret: bool,
) -> Any:
    """The splash kernel for ``heads`` heads of ``tp`` queries over ``sp`` keys, the first
    ``keys`` real (built once per shape: its mask's block map is computed on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class PaddedKeys(sm._ComputableMask):  # computed in the kernel: no mask array is loaded
        def __init__(self) -> None:
            def allowed(q_ids: Any, kv_ids: Any) -> Any:
                seen = kv_ids < keys
                return seen & (q_ids >= kv_ids) if causal else seen & (q_ids >= 0)

            super().__init__(shape=(tp, sp), mask_function=allowed)

        def __eq__(self, other: object) -> bool:
            return self is other

        def __hash__(self) -> int:
            return id(self)

    if keys == sp and not causal:
        one: Any = sm.FullMask((tp, sp))
    elif keys >= sp and causal:
        one = sm.CausalMask((tp, sp))
    else:
        one = PaddedKeys()
    backward: dict[str, Any] = {"block_q_dkv": block_q, "block_kv_dkv": block_k}
    backward["block_kv_dkv_compute"] = block_k
    if fused_backward:
        backward["use_fused_bwd_kernel"] = True
    else:
        backward.update(block_q_dq=block_q, block_kv_dq=block_k)
    blocks = sk.BlockSizes(block_q=block_q, block_kv=block_k, **backward)
    # the kernel holds its mask's block map as arrays: made eagerly, they are constants every
    # trace can share (made under the jit that first asked, they were that trace's tracers,
    # and the cached kernel leaked them into the next: UnexpectedTracerError on the chip)
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            sm.MultiHeadMask([one] * heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def flash(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    is_causal: bool,
    scale: Any,
    interpret: bool,
) -> jax.Array:
    """The Pallas TPU flash kernel (``jax.experimental.pallas.ops.tpu.flash_attention``, layout
    ``[B, N, T, H]``) on ``[B, T, N, H]`` inputs: padded keys and a key-padding mask go in as the
    kernel's segment ids; grouped-query key/value heads are repeated."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    (b, t, n, h), s = query.shape, key.shape[1]
    if key.shape[2] != n:  # grouped-query: query head i reads key/value head i // (N / K)
        key, value = (jnp.repeat(x, n // key.shape[2], axis=2) for x in (key, value))
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if not isinstance(scale, (int, float)):  # a traced scale: the kernel's is static
        query, scale = (query * scale).astype(query.dtype), 1.0
    (block_q, tp), (block_k, sp) = flash_block(t), flash_block(s)
    q, k, v = _layout(query, tp), _layout(key, sp), _layout(value, sp)
    keep = None if mask is None else _keep(mask, b, s)
    if mask is not None and mask.shape[1] != 1:  # a mask per head: heads on the batch axis
        q, k, v = (x.reshape(b * n, 1, *x.shape[2:]) for x in (q, k, v))
    segment_ids = None
    if keep is not None or sp > s:  # the kernel takes a key with the query's segment (1)
        kv = jnp.ones((q.shape[0], s), jnp.int32) if keep is None else keep.astype(jnp.int32)
        kv = jnp.pad(kv, ((0, 0), (0, sp - s)))
        segment_ids = (jnp.ones((q.shape[0], tp), jnp.int32), kv)
    blocks = fa.BlockSizes(
        block_q=block_q,
        block_k_major=block_k,
        block_k=block_k,
        block_b=1,
        block_q_major_dkv=block_q,
        block_k_major_dkv=block_k,
        block_k_dkv=block_k,
        block_q_dkv=block_q,
        block_k_major_dq=block_k,
        block_k_dq=block_k,
        block_q_dq=block_q,
    )

    def kernel(q: jax.Array, k: jax.Array, v: jax.Array, *seg: jax.Array) -> jax.Array:
        ids = fa.SegmentIds(*seg) if seg else None
        return fa.flash_attention(
            q, k, v, None, ids, causal=is_causal, sm_scale=float(scale), block_sizes=blocks
        )

    out = _traced_under(_precision(q.dtype), interpret, kernel, q, k, v, *(segment_ids or ()))
    out = out.reshape(b, -1, tp, h)[:, :, :t].swapaxes(1, 2)  # [B, T, N, H]
    return out if keep is None else _rows_without_keys(out, keep, value, is_causal)


def _layout(x: jax.Array, padded: int) -> jax.Array:
    """``[B, L, N, H]`` -> ``[B, N, padded, H]``, zeros after ``L``."""
    return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0))).swapaxes(1, 2)


def _keep(mask: jax.Array, b: int, s: int) -> jax.Array:
    """A key-padding mask ``[B or 1, N or 1, 1, S]`` as ``[B * (N or 1), S]``."""
    return jnp.broadcast_to(mask[:, :, 0, :], (b, mask.shape[1], s)).reshape(-1, s)


def _rows_without_keys(
    out: jax.Array, keep: jax.Array, value: jax.Array, is_causal: bool
) -> jax.Array:
    """``out`` with each query row that no key takes part in replaced by the mean of the
    values, as XLA gives (the kernels average over the keys they visited, padding included)."""
    (b, t), s = out.shape[:2], keep.shape[-1]
    seen = jnp.cumsum(keep, axis=-1) > 0  # any key <= s takes part
    last = jnp.minimum(jnp.arange(t), s - 1) if is_causal else jnp.full((t,), s - 1)
    has_key = seen[:, last].reshape(b, -1, t).swapaxes(1, 2)[..., None]  # [B, T, N or 1, 1]
    mean = jnp.mean(value.astype(jnp.float32), axis=1, keepdims=True)
    if mean.shape[2] != out.shape[2]:  # grouped-query key/value heads
        mean = jnp.repeat(mean, out.shape[2] // mean.shape[2], axis=2)
    return jnp.where(has_key, out, mean.astype(out.dtype))


def _precision(dtype: Any) -> str:
    """The matmul precision a kernel is traced at: Mosaic takes DEFAULT or HIGHEST, and
    bfloat16 operands only at DEFAULT."""
    asked = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]
    low = dtype == jnp.bfloat16 or asked in (None, "default", "bfloat16")
    return "default" if low else "highest"


def _traced_under(
    precision: str, interpret: bool, kernel: Callable[..., jax.Array], *args: jax.Array
) -> jax.Array:
    """``kernel(*args)`` with its forward and backward Pallas calls traced at ``precision``
    (the default matmul precision) and, with ``interpret``, in TPU interpret mode. ``args``:
    query, key, value, then integer arrays (segment ids: no gradient).

    The kernel's backward is traced when the gradient is taken, after ``attend`` has
    returned, under the caller's settings: a custom VJP sets them again there.
    """
    from jax.experimental.pallas import tpu as pltpu

    def settings() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.default_matmul_precision(precision))
        if interpret:
            stack.enter_context(pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()))
        return stack

    @jax.custom_vjp
    def call(*args: jax.Array) -> jax.Array:
        with settings():
            return kernel(*args)

    def fwd(*args: jax.Array) -> tuple[jax.Array, Any]:
        segment_ids = args[3:]
        with settings():
            return jax.vjp(lambda q, k, v: kernel(q, k, v, *segment_ids), *args[:3])

    def bwd(back: Any, grad: jax.Array) -> tuple[Any, ...]:
        with settings():
            return (*back(grad), *(None,) * (len(args) - 3))  # segment ids: integers

    call.defvjp(fwd, bwd)
    return call(*args)
