"""Ops with kinks, lowered with torch's gradient at the kink.

Away from its kinks such an op has one gradient; at one (an input exactly on a bound) torch
and JAX each pick a convention, and they differ. torchax 0.0.13 lowers ``hardtanh`` (and so
``relu6``) and ``clamp`` as ``jnp.clip``, whose gradient on a bound is 1/2 (``max`` splits a
tie); torch's ``hardtanh_backward`` passes the gradient only strictly inside ``(min, max)``,
its ``clamp_backward`` on the closed interval. JAX's ``abs`` has gradient 1 at 0, torch's
``sgn(0) = 0`` (which is also why ``F.logsigmoid`` had gradient 1 at 0 instead of 1/2: torch's
decomposition computes it through ``abs``). Exact ties are not rare: a BatchNorm in eval mode
with zero bias maps the zeros a ReLU6 made to exact zeros, which the next ReLU6 meets on its
bound (torchvision's MobileNetV2: every BatchNorm bias of its last block got a gradient where
torch's is 0). Each lowering here computes the forward as torch does and the gradient by
torch's ``derivatives.yaml`` formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch


def _keep(x: jax.Array, pass_: jax.Array, value: jax.Array) -> jax.Array:
    """``value`` (equal to ``x`` where ``pass_``) whose gradient is ``x``'s where ``pass_``
    and 0 elsewhere: a select, so no ``0 * inf`` reaches a NaN."""
    return jnp.where(pass_, x, jax.lax.stop_gradient(value))


def hardtanh(x: jax.Array, min_val: float = -1.0, max_val: float = 1.0) -> jax.Array:
    """``F.hardtanh`` / ``F.relu6``: the gradient passes strictly inside ``(min, max)``."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.clip(x, int(min_val), int(max_val)).astype(x.dtype)
    return _keep(x, (x > min_val) & (x < max_val), jnp.clip(x, min_val, max_val))


def relu6(x: jax.Array) -> jax.Array:
    return hardtanh(x, 0.0, 6.0)


def _dtype(x: Any, *bounds: Any) -> Any:
    """The result type of ``clamp(x, min, max)``: a Python number is weakly typed (a float
    bound makes an integer ``x`` float, and keeps a bfloat16 one bfloat16), as in torch."""
    return jnp.result_type(x, *(b for b in bounds if b is not None))


def clamp(x: jax.Array, min: Any = None, max: Any = None) -> jax.Array:
    """``torch.clamp`` (bounds numbers or tensors): the result is one of ``x``, ``min``,
    ``max``, and the gradient goes to that one (torch's ``clamp_backward`` and
    ``clamp_backward_min_max``): ``x`` on the closed interval, ``min`` where ``x < min``
    (and ``min < max``), ``max`` where ``x > max`` (or ``max < min``)."""
    dtype = _dtype(x, min, max)
    x = x.astype(dtype)
    lo = None if min is None else jnp.asarray(min, dtype)
    hi = None if max is None else jnp.asarray(max, dtype)
    if lo is None and hi is None:
        raise ValueError("torch.clamp: at least one of min and max must be given")
    value = jnp.clip(x, lo, hi)
    if not jnp.issubdtype(dtype, jnp.floating):
        return value
    if lo is not None and hi is not None:
        inside = (x >= lo) & (x <= hi)
        to_lo = (x < lo) & (lo < hi)
        to_hi = (x > hi) | (hi < lo)
        out = jnp.where(to_hi, hi, jax.lax.stop_gradient(value))
        return jnp.where(inside, x, jnp.where(to_lo, lo, out))
    if lo is not None:
        return jnp.where(x >= lo, x, jnp.where(x < lo, lo, jax.lax.stop_gradient(value)))
    assert hi is not None
    return jnp.where(x <= hi, x, jnp.where(x > hi, hi, jax.lax.stop_gradient(value)))


def clamp_min(x: jax.Array, min: Any) -> jax.Array:
    return clamp(x, min=min)


def clamp_max(x: jax.Array, max: Any) -> jax.Array:
    return clamp(x, max=max)


@jax.custom_jvp
def _abs(x: jax.Array) -> jax.Array:
    return jnp.abs(x)


@_abs.defjvp
def _abs_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[Any, Any]:
    (x,), (t,) = primals, tangents
    return jnp.abs(x), t * jnp.sign(x)  # torch: grad * sgn(x), 0 at 0


def abs_(x: jax.Array) -> jax.Array:
    """``torch.abs``: gradient ``sgn(x)``, 0 at 0 (JAX's is 1 there)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.abs(x)
    return _abs(x)


def leaky_relu(x: jax.Array, negative_slope: float = 0.01) -> jax.Array:
    """``F.leaky_relu``: ``x > 0 ? x : slope * x``, so the gradient at 0 is the slope."""
    return jnp.where(x > 0, x, x * jnp.asarray(negative_slope, x.dtype))


def hardsigmoid(x: jax.Array) -> jax.Array:
    """``F.hardsigmoid``: ``relu6(x + 3) / 6``, gradient 1/6 strictly inside (-3, 3)."""
    value = jnp.clip(x + 3, 0, 6) / 6
    return jnp.where((x > -3) & (x < 3), (x + 3) / 6, jax.lax.stop_gradient(value))


@jax.custom_jvp
def _hardswish(x: jax.Array) -> jax.Array:
    return x * jnp.clip(x + 3, 0, 6) / 6


@_hardswish.defjvp
def _hardswish_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[Any, Any]:
    (x,), (t,) = primals, tangents
    # torch's hardswish_backward: 0 for x <= -3, x / 3 + 1/2 below 3, 1 from 3
    slope = jnp.where(x <= -3, 0.0, jnp.where(x < 3, x / 3 + 0.5, 1.0)).astype(x.dtype)
    return _hardswish(x), t * slope


def hardswish(x: jax.Array) -> jax.Array:
    return _hardswish(x)


def kink_lowerings() -> dict[Any, Callable[..., Any]]:
    """aten op -> lowering, for :func:`torchshell.trace.environment`."""
    aten = torch.ops.aten
    return {
        aten.hardtanh.default: hardtanh,
        aten.relu6.default: relu6,
        aten.clamp.default: clamp,
        aten.clamp.Tensor: clamp,
        aten.clamp_min.default: clamp_min,
        aten.clamp_min.Tensor: clamp_min,
        aten.clamp_max.default: clamp_max,
        aten.clamp_max.Tensor: clamp_max,
        aten.abs.default: abs_,
        aten.leaky_relu.default: leaky_relu,
        aten.hardsigmoid.default: hardsigmoid,
        aten.hardswish.default: hardswish,
    }
