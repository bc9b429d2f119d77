"""Dot-product attention as one call: cuDNN's fused kernel on a CUDA GPU and the Pallas flash
kernel on a TPU where they apply, XLA elsewhere.

``jax.nn.dot_product_attention`` (jax 0.10.2) takes ``implementation=None`` to mean XLA on
every backend (its own note: "defaults to XLA for now"): a GPU gets the fused kernel only when
``implementation="cudnn"`` is asked for, and that raises where cuDNN does not apply
(float32, a head dim over 128/256 or not a multiple of 8, no cuDNN). :func:`attend` asks for
cuDNN on a GPU with bfloat16/float16 inputs and takes XLA where cuDNN refuses, so a caller
never picks by hand. The recipes' Flax encoder and the lowering of torch's
``F.scaled_dot_product_attention`` / ``nn.MultiheadAttention`` in a traced torch module
(``torchshell.trace``) both call it.

On a TPU it takes the Pallas flash kernel (``jax.experimental.pallas.ops.tpu.flash_attention``,
layout ``[B, N, T, H]``), which never writes the ``[T, S]`` logits to memory. On a v5e, fwd+bwd
in bfloat16 at ``[16, 1500, 8, 64]`` took 7.6 ms against XLA's 12.9, at ``[8, 1024, 12, 64]``
2.9 against 4.6, at ``[16, 768, 8, 64]`` 2.5 against 3.4; at ``T = 640`` both 1.9 and at
``[8, 512, 12, 64]`` XLA 0.45 against 0.89: left to pick, :func:`attend` takes the kernel from
``_PALLAS_MIN_LENGTH`` (640) query or key tokens on. The lengths are padded up to the kernel's
block (:func:`_block`), the padded keys masked by the kernel's segment ids, as are the keys of a
key-padding ``mask`` (``[B or 1, N or 1, 1, S]``; one per head puts the heads on the kernel's
batch axis); padded query rows are sliced off. Grouped-query key/value heads are repeated. The
kernel's own bias input (a full ``[B, N, T, S]`` array, and its gradient another) measured
slower than XLA, so a ``bias``, or a mask that varies along the query axis, takes XLA; so do a
value head dim unlike the query's, a head dim not a multiple of 8 up to 256 (32 to 256 ran),
dtypes other than bfloat16/float32. ``implementation="pallas"`` asked for by name raises on
those instead, and off a TPU unless ``interpret=True``, which runs the kernel in Pallas' TPU
interpret mode on the CPU (the tests' way in; slow). The kernel is traced at the DEFAULT
matmul precision (HIGHEST for float32 where the caller set a higher default): Mosaic takes no
other, and bfloat16 operands only at DEFAULT.

Masked logits are set to a large finite negative (``-0.7 * finfo.max``), not ``-inf``: a query
row whose keys are all masked averages the values uniformly instead of giving NaN (the Pallas
path too).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["attend", "implementation_for"]

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_PALLAS_DTYPES = (jnp.bfloat16, jnp.float32)
_PALLAS_MIN_LENGTH = 640  # below it XLA was as fast or faster on a v5e (module notes)
_PALLAS_MAX_BLOCK = 1024
_IMPLEMENTATIONS = (None, "xla", "cudnn", "pallas")


def implementation_for(query: jax.Array) -> str:
    """``"cudnn"`` where the fused kernel may apply (a GPU, bfloat16/float16), ``"pallas"`` on a
    TPU (bfloat16/float32), else ``"xla"``.

    Example:
        >>> implementation_for(jnp.ones((1, 4, 2, 8), jnp.bfloat16))  # on CPU
        'xla'
    """
    backend = jax.default_backend()
    if backend == "gpu" and query.dtype in _CUDNN_DTYPES:
        return "cudnn"
    if backend == "tpu" and query.dtype in _PALLAS_DTYPES:
        return "pallas"
    return "xla"


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``softmax(q k^T * scale + bias, masked) v`` per head, in ``[B, T, N, H]`` layout.

    Args:
        query: ``[B, T, N, H]``.
        key: ``[B, S, K, H]``; ``K`` divides ``N`` (grouped-query attention when ``K < N``).
        value: ``[B, S, K, H]``.
        bias: additive logits bias, 4-D, broadcastable to ``[B, N, T, S]``.
        mask: boolean, ``True`` where a key takes part, 4-D, broadcastable to ``[B, N, T, S]``.
        is_causal: query ``t`` sees keys ``<= t`` (top-left aligned, as torch).
        scale: logits scale; ``1 / sqrt(H)`` when ``None``.
        implementation: ``"xla"``, ``"cudnn"`` or ``"pallas"``; ``None`` picks
            (:func:`implementation_for`), falling back to XLA where the kernel refuses the
            inputs (for Pallas also a bias, a mask along the query axis, and sequences shorter
            than ``_PALLAS_MIN_LENGTH``: see the module notes). Asked for by name, a kernel
            that refuses raises.
        interpret: with the Pallas kernel, run it in Pallas' TPU interpret mode (on the CPU,
            for tests: slow); ignored by the other implementations.

    Returns:
        ``[B, T, N, H]`` in the inputs' dtype (logits and softmax computed in float32).

    Example:
        >>> q = jnp.ones((2, 5, 4, 8))
        >>> mask = jnp.array([[True] * 3 + [False] * 2, [True] * 5])[:, None, None, :]
        >>> attend(q, q, q, mask=mask).shape
        (2, 5, 4, 8)
        >>> q = jnp.ones((1, 130, 2, 32))  # the kernel, interpreted: T padded to 256
        >>> attend(q, q, q, is_causal=True, implementation="pallas", interpret=True).shape
        (1, 130, 2, 32)
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            "attend: implementation must be None, 'xla', 'cudnn' or 'pallas', got "
            f"{implementation!r}. Fix: leave it None to use a fused kernel where it applies."
        )
    chosen = implementation or implementation_for(query)
    if chosen == "cudnn":
        t, s = query.shape[1], key.shape[1]
        try:  # cuDNN reads a bias or mask of the full [.., T, S]: broadcast the query axis
            return jax.nn.dot_product_attention(
                query,
                key,
                value,
                None if bias is None else _full(bias, t, s).astype(query.dtype),
                None if mask is None else _full(mask, t, s),
                scale=scale,
                is_causal=is_causal,
                implementation="cudnn",
            )
        except (NotImplementedError, ValueError, RuntimeError):
            if implementation == "cudnn":
                raise
    if chosen == "pallas":
        refusal = _pallas_refusal(query, key, value, bias, mask, implementation, interpret)
        if refusal is None:
            return _pallas(query, key, value, mask, is_causal, scale, interpret)
        if implementation == "pallas":
            raise ValueError(
                f"attend: the Pallas flash kernel cannot take {refusal}. Fix: leave "
                "implementation=None to fall back to XLA where the kernel does not apply."
            )
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, implementation="xla"
    )


def _pallas_refusal(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    implementation: str | None,
    interpret: bool,
) -> str | None:
    """Why the Pallas kernel does not apply here (``None``: it does)."""
    if not query.ndim == key.ndim == value.ndim == 4:
        return f"query {query.shape}, key {key.shape}, value {value.shape} (4-D: [B, T, N, H])"
    (b, t, n, h), (s, kh) = query.shape, key.shape[1:3]
    if not interpret and jax.default_backend() != "tpu":
        return f"the {jax.default_backend()} backend (it runs on a TPU; interpret=True on CPU)"
    if query.dtype not in _PALLAS_DTYPES or not query.dtype == key.dtype == value.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (bfloat16 or float32, alike)"
    if value.shape[-1] != h:
        return f"a value head dim {value.shape[-1]} unlike the query's {h}"
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != h or n % kh:
        return f"query {query.shape}, key {key.shape}, value {value.shape}"
    if h % 8 or h > 256:
        return f"head dim {h} (a multiple of 8 up to 256)"
    if bias is not None:
        return "a bias (it takes a key-padding mask only)"
    if mask is not None and (mask.ndim != 4 or mask.shape[2] != 1 or mask.shape[1] not in (1, n)):
        return f"a mask of shape {mask.shape} (a key-padding mask only: [B, N or 1, 1, S])"
    if implementation is None and max(t, s) < _PALLAS_MIN_LENGTH:
        return f"sequences shorter than {_PALLAS_MIN_LENGTH} (XLA is as fast there)"
    return None


def _block(length: int) -> tuple[int, int]:
    """The kernel's block along a sequence of ``length`` and the length padded to it.

    One block of ``length`` rounded up to 128 up to 1024; past it the block of 512 to 1024
    (a multiple of 128) that pads least, the largest of those: on a v5e at ``T = 1500``
    blocks of 768 took 7.6 ms, 512 8.4, 384 10.6, 256 14.1; at 1152, 640 (no padding past
    1280) took 5.7 ms and 512 (1536) 8.2.
    """
    whole = -(-length // 128) * 128
    if whole <= _PALLAS_MAX_BLOCK:
        return whole, whole
    padded = {
        block: -(-length // block) * block for block in range(512, _PALLAS_MAX_BLOCK + 1, 128)
    }
    block = min(padded, key=lambda b: (padded[b], -b))
    return block, padded[block]


def _pallas(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    is_causal: bool,
    scale: Any,
    interpret: bool,
) -> jax.Array:
    """The Pallas TPU flash kernel on ``[B, T, N, H]`` inputs (see the module notes)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    (b, t, n, h), s = query.shape, key.shape[1]
    if key.shape[2] != n:  # grouped-query: query head i reads key/value head i // (N / K)
        key, value = (jnp.repeat(x, n // key.shape[2], axis=2) for x in (key, value))
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if not isinstance(scale, (int, float)):  # a traced scale: the kernel's is static
        query, scale = (query * scale).astype(query.dtype), 1.0
    (block_q, tp), (block_k, sp) = _block(t), _block(s)

    def layout(x: jax.Array, padded: int) -> jax.Array:  # [B, L, N, H] -> [B, N, Lp, H]
        return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0))).swapaxes(1, 2)

    q, k, v = layout(query, tp), layout(key, sp), layout(value, sp)
    keep = None  # [B * heads of the mask, S]: the keys that take part
    if mask is not None:
        keep = jnp.broadcast_to(mask[:, :, 0, :], (b, mask.shape[1], s)).reshape(-1, s)
        if mask.shape[1] != 1:  # a mask per head: the heads go to the kernel's batch axis
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

    # Mosaic takes a dot's precision DEFAULT or HIGHEST, and bfloat16 operands only at DEFAULT
    asked = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]
    low = q.dtype == jnp.bfloat16 or asked in (None, "default", "bfloat16")
    precision = "default" if low else "highest"
    out = _traced_under(precision, interpret, kernel, q, k, v, *(segment_ids or ()))
    out = out.reshape(b, -1, tp, h)[:, :, :t].swapaxes(1, 2)  # [B, T, N, H]
    if keep is None:
        return out
    # a query row with no key left averages the values, as XLA (the kernel: over the padding)
    seen = jnp.cumsum(keep, axis=-1) > 0  # any key <= s takes part
    last = jnp.minimum(jnp.arange(t), s - 1) if is_causal else jnp.full((t,), s - 1)
    has_key = seen[:, last].reshape(b, -1, t).swapaxes(1, 2)[..., None]  # [B, T, N or 1, 1]
    mean = jnp.mean(value.astype(jnp.float32), axis=1, keepdims=True).astype(out.dtype)
    return jnp.where(has_key, out, mean)


def _traced_under(
    precision: str, interpret: bool, kernel: Callable[..., jax.Array], *args: jax.Array
) -> jax.Array:
    """``kernel(*args)`` with its forward and backward Pallas calls traced at ``precision``
    (the default matmul precision) and, with ``interpret``, in TPU interpret mode.

    The kernel's backward is traced when the gradient is taken, after :func:`attend` has
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


def _full(x: jax.Array, t: int, s: int) -> jax.Array:
    """A 4-D bias or mask with its last two axes broadcast to ``[t, s]``."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return jnp.broadcast_to(x, (*x.shape[:2], t, s))
