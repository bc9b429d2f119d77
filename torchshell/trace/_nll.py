"""``nll_loss`` (what ``F.cross_entropy`` and ``F.nll_loss`` run on class indices) as a
one-hot select, not a gather.

torchax takes torch's decomposition of ``aten.nll_loss_forward``: a gather of each row's
target class, whose gradient JAX writes as a scatter into a zero buffer of the whole
``[rows, classes]`` input. For a language model that buffer is the logits' size: on a TPU v5e
the scatter, its zero fill and a reshape were 4.5 ms of GPT-2 small's 101 ms step
(``benchmarks/tpu_profile.py gpt-j``). Here each row's value is the sum over the class axis of
``where(class == target, x, 0)``: the gradient is a select that XLA fuses with the log-softmax
around it. torch's rules are kept: ``ignore_index`` rows give 0 and weigh 0, ``weight``
weighs each row by its target's class, ``mean`` divides by the summed weight (NaN when every
row is ignored, as torch), sums accumulate in float32 and the result keeps the input's dtype.
A target outside ``[0, C)`` that is not ``ignore_index`` (torch: ``IndexError: Target N is out
of bounds``; the select: 0) is reported in the step (:func:`._targets.class_range_check`)
where ``F.cross_entropy``/``F.nll_loss``'s own check did not already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshell.trace._targets import class_range_check, range_already_checked

__all__ = ["nll_loss_forward", "nll_lowerings"]

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's reduction enum


def nll_loss_forward(
    x: jax.Array,
    target: jax.Array,
    weight: jax.Array | None = None,
    reduction: int = _MEAN,
    ignore_index: int = -100,
) -> tuple[jax.Array, jax.Array]:
    """``aten.nll_loss_forward`` / ``nll_loss2d_forward``: ``(output, total_weight)``.

    ``x`` is ``[C]``, ``[N, C]`` or ``[N, C, d1, ...]`` log-probabilities, ``target`` its
    shape without the class axis.

    Example:
        >>> import torch.nn.functional as F
        >>> x = torch.randn(4, 5).log_softmax(1)
        >>> y = torch.tensor([0, 4, -100, 2])
        >>> out, _ = nll_loss_forward(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
        >>> bool(jnp.allclose(out, F.nll_loss(x, y).item(), atol=1e-6))
        True
    """
    axis = 0 if x.ndim == 1 else 1
    classes = x.shape[axis]
    if not range_already_checked():  # (aten.nll_loss called straight, or an import of F's)
        class_range_check("nll_loss", target, classes, ignore_index)
    target = target.astype(jnp.int32)
    picked_at = jnp.expand_dims(target, axis) == jax.lax.broadcasted_iota(
        jnp.int32, (1,) * axis + (classes,) + (1,) * (x.ndim - axis - 1), axis
    )
    valid = target != ignore_index
    if weight is None:
        w = valid.astype(jnp.float32)
    else:
        w = jnp.where(valid, jnp.take(weight, jnp.clip(target, 0, classes - 1)), 0.0)
        w = w.astype(jnp.float32)
    picked = jnp.sum(jnp.where(picked_at, x, jnp.zeros((), x.dtype)), axis=axis)
    losses = -picked.astype(jnp.float32) * w
    if reduction == _NONE:
        return losses.astype(x.dtype), jnp.zeros((), x.dtype)
    total = jnp.sum(w)
    out = jnp.sum(losses)
    if reduction == _MEAN:
        out = out / total
    return out.astype(x.dtype), total.astype(x.dtype)


def nll_lowerings() -> dict[Any, Callable[..., Any]]:
    """The aten ops this module lowers, for the trace's table (``_env.py``)."""
    aten = torch.ops.aten
    return {
        aten.nll_loss_forward.default: nll_loss_forward,
        aten.nll_loss2d_forward.default: nll_loss_forward,
    }
