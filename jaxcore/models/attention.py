"""Dot-product attention as one call: cuDNN's fused kernel on a CUDA GPU and a Pallas kernel
(splash attention, else flash) on a TPU where they apply, XLA elsewhere.

``jax.nn.dot_product_attention`` (jax 0.10.2) takes ``implementation=None`` to mean XLA on
every backend (its own note: "defaults to XLA for now"): a GPU gets the fused kernel only when
``implementation="cudnn"`` is asked for, and that raises where cuDNN does not apply
(float32, a head dim over 128/256 or not a multiple of 8, no cuDNN). :func:`attend` asks for
cuDNN on a GPU with bfloat16/float16 inputs and takes XLA where cuDNN refuses, so a caller
never picks by hand. The recipes' Flax encoder and the lowering of torch's
``F.scaled_dot_product_attention`` / ``nn.MultiheadAttention`` in a traced torch module
(``torchshell.trace``) both call it.

On a TPU it takes a Pallas kernel (``jaxcore.models._tpu_attention``), which never writes the
``[T, S]`` logits to memory: splash attention (MaxText's: a logsumexp residual, masked blocks
skipped) where the kernels apply; the flash kernel (``implementation="flash"``, also
``"pallas"``), which applies to the same inputs, only asked for by name. On a v5e the flash
kernel's fwd+bwd in bfloat16 at ``[16, 1500, 8, 64]`` took 7.6 ms against XLA's 12.9, at
``[8, 1024, 12, 64]`` 2.9 against 4.6, at ``[16, 768, 8, 64]`` 2.5 against 3.4; at
``T = 640`` both 1.9 and at ``[8, 512, 12, 64]`` XLA 0.45 against 0.89: left to pick,
:func:`attend` takes a kernel from ``_PALLAS_MIN_LENGTH`` (640) query or key tokens on
(splash's own crossover is not measured yet: ``benchmarks/attention_tpu.py``). The
lengths are padded up to the kernel's block, the padded keys masked, as are the keys of a
key-padding ``mask`` (``[B or 1, N or 1, 1, S]``); padded query rows are sliced off. The
kernels' bias inputs measured slower than XLA (flash) or are absent (splash), so a ``bias``,
or a mask that varies along the query axis, takes XLA; so do a value head dim unlike the
query's, a head dim not a multiple of 8 up to 256 (32 to 256 ran with flash), dtypes other
than bfloat16/float32. A kernel asked for by name raises on those instead, and off a TPU
unless ``interpret=True``, which runs it in Pallas' interpret mode on the CPU (the tests' way
in; slow).

Masked logits are set to a large finite negative (``-0.7 * finfo.max``), not ``-inf``: a query
row whose keys are all masked averages the values uniformly instead of giving NaN (the Pallas
kernels too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcore.models import _tpu_attention

__all__ = ["attend", "implementation_for"]

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_PALLAS_DTYPES = (jnp.bfloat16, jnp.float32)
_PALLAS_MIN_LENGTH = 640  # below it XLA was as fast or faster than flash on a v5e (notes)
_IMPLEMENTATIONS = (None, "xla", "cudnn", "splash", "flash", "pallas")
_KERNELS = {"splash": "splash attention", "flash": "flash", "pallas": "flash"}


def implementation_for(query: jax.Array) -> str:
    """``"cudnn"`` where the fused kernel may apply (a GPU, bfloat16/float16), ``"splash"`` on a
    TPU (bfloat16/float32; :func:`attend` takes XLA where it refuses), else ``"xla"``.

    Example:
        >>> implementation_for(jnp.ones((1, 4, 2, 8), jnp.bfloat16))  # on CPU
        'xla'
    """
    backend = jax.default_backend()
    if backend == "gpu" and query.dtype in _CUDNN_DTYPES:
        return "cudnn"
    if backend == "tpu" and query.dtype in _PALLAS_DTYPES:
        return "splash"
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
        implementation: ``"xla"``, ``"cudnn"``, ``"splash"`` or ``"flash"`` (``"pallas"``: the
            same); ``None`` picks (:func:`implementation_for`), falling back to XLA where the
            kernel refuses the inputs (the Pallas kernels, splash and flash alike, also refuse a
            bias, a mask along the query axis, and sequences shorter than
            ``_PALLAS_MIN_LENGTH``: see the module notes). Asked for by name, a kernel that
            refuses raises.
        interpret: with a Pallas kernel, run it in Pallas' interpret mode (on the CPU, for
            tests: slow); ignored by the other implementations.

    Returns:
        ``[B, T, N, H]`` in the inputs' dtype (logits and softmax computed in float32).

    Example:
        >>> q = jnp.ones((2, 5, 4, 8))
        >>> mask = jnp.array([[True] * 3 + [False] * 2, [True] * 5])[:, None, None, :]
        >>> attend(q, q, q, mask=mask).shape
        (2, 5, 4, 8)
        >>> q = jnp.ones((1, 130, 2, 32))  # a kernel, interpreted: T padded to 256
        >>> attend(q, q, q, is_causal=True, implementation="splash", interpret=True).shape
        (1, 130, 2, 32)
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            "attend: implementation must be None, 'xla', 'cudnn', 'splash' or 'flash' "
            f"('pallas'), got {implementation!r}. Fix: leave it None to use a fused kernel "
            "where it applies."
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
    if chosen in _KERNELS:
        refusal = _pallas_refusal(query, key, value, bias, mask, implementation, interpret)
        if refusal is None:
            run = _tpu_attention.splash if chosen == "splash" else _tpu_attention.flash
            return run(query, key, value, mask, is_causal, scale, interpret)
        if implementation is not None:
            raise ValueError(
                f"attend: the Pallas {_KERNELS[chosen]} kernel cannot take {refusal}. Fix: leave "
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
    """Why the Pallas kernels (splash and flash alike) do not apply here (``None``: they do)."""
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


def _full(x: jax.Array, t: int, s: int) -> jax.Array:
    """A 4-D bias or mask with its last two axes broadcast to ``[t, s]``."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return jnp.broadcast_to(x, (*x.shape[:2], t, s))
