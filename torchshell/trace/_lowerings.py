"""JAX lowerings of torch ops torchax 0.0.13 lacks or gets wrong (windows, bincount,
``_grouped_mm``, ``multilabel_margin_loss``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshell._errors import TorchModelError

WINDOWS = ("hann", "hamming", "blackman", "bartlett")


def window(kind: str) -> Callable[..., jax.Array]:
    """torch's ``<kind>_window(n, periodic=True, [alpha, beta], dtype=...)`` in JAX.

    Example:
        >>> import torch
        >>> w = window("hann")(64)
        >>> bool(jnp.allclose(w, jnp.asarray(torch.hann_window(64).numpy()), atol=1e-6))
        True
    """

    def values(
        n: int, periodic: bool = True, alpha: float = 0.54, beta: float = 0.46, **kw: Any
    ) -> jax.Array:
        from torchax.ops import mappings

        dtype = mappings.t2j_dtype(kw.get("dtype") or torch.get_default_dtype())
        if n <= 1:
            return jnp.ones((n,), dtype)
        k = jnp.arange(n, dtype=jnp.float32)
        step = 2 * jnp.pi * k / (n if periodic else n - 1)  # periodic: one of n + 1, last dropped
        if kind == "hann":
            w = 0.5 - 0.5 * jnp.cos(step)
        elif kind == "hamming":
            w = alpha - beta * jnp.cos(step)
        elif kind == "blackman":
            w = 0.42 - 0.5 * jnp.cos(step) + 0.08 * jnp.cos(2 * step)
        else:  # bartlett
            w = 1 - jnp.abs(step / jnp.pi - 1)
        return w.astype(dtype)

    return values


def multilabel_margin_loss(
    x: jax.Array, target: jax.Array, reduction: int
) -> tuple[jax.Array, jax.Array]:
    """``F.multilabel_margin_loss`` as torch's kernel computes it: a row's targets are its
    class indices up to the first ``-1``; each (target j, non-target i) pair adds
    ``max(0, 1 - x[j] + x[i]) / C``. Returns ``(loss, is_target)``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> x = torch.tensor([[0.1, 0.2, 0.4, 0.8], [0.3, -0.2, 0.5, 0.1]])
        >>> t = torch.tensor([[3, 0, -1, 1], [2, -1, 0, 0]])
        >>> loss, _ = multilabel_margin_loss(jnp.asarray(x.numpy()), jnp.asarray(t.numpy()), 1)
        >>> round(float(loss), 5) == round(float(F.multilabel_margin_loss(x, t)), 5)
        True
    """
    rows, labels = jnp.atleast_2d(x), jnp.atleast_2d(target)
    classes = jnp.arange(rows.shape[1])
    end = jnp.min(jnp.where(labels == -1, classes, rows.shape[1]), axis=-1, keepdims=True)
    valid = classes < end  # [B, slot]: the slots before the first -1
    scores = jnp.take_along_axis(rows, jnp.where(valid, labels, 0), axis=-1)  # [B, slot]
    hit = classes[None, None, :] == jnp.where(valid, labels, -1)[:, :, None]
    is_target = jnp.any(hit, axis=1)  # [B, class]
    z = jnp.maximum(1.0 - scores[:, :, None] + rows[:, None, :], 0.0) / rows.shape[1]
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :], z, 0.0)
    per_row = z.sum(axis=(1, 2))
    if reduction == 1:
        loss = per_row.mean()
    elif reduction == 2:
        loss = per_row.sum()
    else:
        loss = per_row.reshape(x.shape[:-1])
    return loss, is_target.astype(x.dtype).reshape(target.shape)


def bincount(x: jax.Array, weights: jax.Array | None = None, minlength: int = 0) -> jax.Array:
    """``torch.bincount`` with ``minlength`` bins (torchmetrics' confusion counts).

    torch's length is ``max(minlength, x.max() + 1)``, a value; traced, it is ``minlength``
    (a value past it, which torch would count in a longer result, is not counted).
    """
    if not minlength:
        raise TorchModelError(
            "torch.bincount without minlength has a length that depends on the values, which "
            "a compiled JAX step cannot have. Fix: pass minlength= (the number of bins)."
        )
    counts = jnp.bincount(x, weights, length=int(minlength))
    return counts if weights is not None else counts.astype(jnp.int32)


def grouped_mm(
    a: jax.Array,
    b: jax.Array,
    offs: jax.Array | None = None,
    bias: jax.Array | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """``torch._grouped_mm``: the experts of a mixture-of-experts layer in one matmul.

    transformers' default experts (Mixtral, Qwen-MoE, OLMoE...: ``grouped_mm_experts_forward``)
    sort the routed rows by expert and multiply ``a [rows, K]`` by ``b[g] [K, M]`` for the rows
    of group ``g`` (``offs``: where each group ends). That is ``lax.ragged_dot`` with the
    groups' sizes; rows past the last group come out 0 (torch leaves them unset). Batched
    ``[G, N, K] @ [G, K, M]`` without ``offs`` is a plain matmul.
    """
    if bias is not None:
        raise TorchModelError(
            "torch._grouped_mm with bias= is not lowered to JAX (torch has it on CUDA only). "
            "Fix: add the bias after the grouped matmul."
        )
    if a.ndim == 2 and b.ndim == 3 and offs is not None:
        sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
        out = jax.lax.ragged_dot(a, b, sizes)
    elif a.ndim == 3 and b.ndim == 3 and offs is None:
        out = jnp.matmul(a, b)
    else:
        raise TorchModelError(
            f"torch._grouped_mm of a {a.ndim}-D by a {b.ndim}-D tensor "
            f"{'with' if offs is not None else 'without'} offs is not lowered to JAX: only "
            "[rows, K] x [groups, K, M] with offs (mixture-of-experts layers) and batched "
            "[groups, N, K] x [groups, K, M]. Fix: write the experts as a loop of matmuls."
        )
    if out_dtype is None:
        return out
    from torchax.ops import mappings

    return out.astype(
        mappings.t2j_dtype(out_dtype) if isinstance(out_dtype, torch.dtype) else out_dtype
    )


def sample_dirichlet(alpha: jax.Array, generator: Any = None, *, env: Any) -> jax.Array:
    """``torch._sample_dirichlet`` (behind ``torch.distributions.Beta``/``Dirichlet``'s
    ``sample()``, mixup's lambda): a draw from the trace's key, new every step.

    Example:
        >>> import torchax
        >>> env = torchax.tensor.Environment()  # (a trace's own; not the process-wide one)
        >>> x = sample_dirichlet(jnp.full((4, 2), 0.4), env=env)
        >>> x.shape, bool(jnp.allclose(x.sum(-1), 1.0))
        ((4, 2), True)
    """
    key = env.get_and_rotate_prng_key(generator)
    draw = jax.random.dirichlet(key, alpha.astype(jnp.float32))
    return draw.astype(alpha.dtype)


def standard_gamma(alpha: jax.Array, generator: Any = None, *, env: Any) -> jax.Array:
    """``torch._standard_gamma`` (``torch.distributions.Gamma``, ``Beta.rsample()``): a
    draw from the trace's key, differentiable in ``alpha`` as torch's is.

    Example:
        >>> import torchax
        >>> env = torchax.tensor.Environment()  # (a trace's own; not the process-wide one)
        >>> x = standard_gamma(jnp.full((3,), 2.0), env=env)
        >>> x.shape, bool((x > 0).all())
        ((3,), True)
    """
    key = env.get_and_rotate_prng_key(generator)
    return jax.random.gamma(key, alpha.astype(jnp.float32)).astype(alpha.dtype)
