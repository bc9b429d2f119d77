"""Ops torchax 0.0.13 does not lower (or lowers wrongly), and torch's dtype refusals.

- ``aten::adaptive_max_pool2d``/``3d`` (``F.adaptive_max_pool1d``/``2d``/``3d``,
  ``nn.AdaptiveMaxPool*d``, ``return_indices`` too) had no lowering: each output takes the
  max over torch's window ``[floor(i * n / out), ceil((i + 1) * n / out))``, the first
  maximum (the last NaN) as torch's kernel, and the gradient goes to that element only.
- ``aten::cummax``/``cummin``: torchax's lowering failed on a negative ``dim`` and split the
  gradient between tied elements (``jnp.maximum``); torch's index is the *last* extreme
  (NaN wins, the last NaN), and its gradient goes to that index only.
- ``aten::rrelu_with_noise`` (``F.rrelu``, ``nn.RReLU``) had no lowering: in eval a leaky
  relu with slope ``(lower + upper) / 2``, in training a slope drawn per element from
  ``U(lower, upper)`` where ``x <= 0``, from the step's key (as dropout draws).
- ``Tensor.normal_`` failed in torchax (no functional ``aten::normal`` overload takes its
  arguments); ``normal_``/``uniform_``/``exponential_`` draw from the step's key, in the
  tensor's dtype, with torch's argument checks (the functional ``aten::uniform`` too: torchax
  asserted ``from <= to``, a bare ``AssertionError``; ``exponential_`` drew from a fixed key).
- Matmuls and convolutions refuse operands of different dtypes at trace time as torch does
  (:mod:`._dtypes`, installed from here after the lowerings it wraps).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshell._errors import TorchModelError
from torchshell.trace._dtypes import _module_site, install_dtype_checks


def _windows(n_in: int, n_out: int) -> np.ndarray:
    """``[n_out, k]`` input positions of each adaptive window (the last one repeated to pad
    to the widest, which changes neither the max nor the first maximum's position)."""
    starts = [(i * n_in) // n_out for i in range(n_out)]
    ends = [-(-((i + 1) * n_in) // n_out) for i in range(n_out)]
    k = max(e - s for s, e in zip(starts, ends, strict=True))
    return np.array(
        [[min(s + j, e - 1) for j in range(k)] for s, e in zip(starts, ends, strict=True)]
    )


def _first_max(win: jax.Array) -> jax.Array:
    """The position along the last axis torch's max pooling keeps: the first maximum, or
    the last NaN where there is one (its kernel takes ``val > max || isnan(val)``)."""
    if not jnp.issubdtype(win.dtype, jnp.floating):
        return jnp.argmax(win, axis=-1)
    nan = jnp.isnan(win)
    last_nan = win.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    first = jnp.argmax(jnp.where(nan, -jnp.inf, win), axis=-1)
    return jnp.where(nan.any(-1), last_nan, first)


def adaptive_max_pool(x: jax.Array, output_size: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """``aten::adaptive_max_pool{2,3}d``: ``(values, indices)``, the indices flat over each
    plane's spatial positions (what ``F.max_unpool*d`` takes).

    Example:
        >>> v, i = adaptive_max_pool(jnp.array([[[1.0, 5.0, 2.0, 5.0, 0.0]]]), [1, 2])
        >>> v.tolist(), i.tolist()
        ([[[5.0, 5.0]]], [[[1, 3]]])
    """
    k = len(output_size)
    sizes = x.shape[x.ndim - k :]
    if any(s == 0 for s in sizes) or any(int(o) <= 0 for o in output_size):
        raise TorchModelError(
            f"adaptive_max_pool{k}d: input of shape {tuple(x.shape)} to output size "
            f"{tuple(output_size)}: torch needs non-empty spatial dimensions and output sizes "
            "> 0. Fix: check the pooled tensor's shape and the output size."
        )
    lead = x.ndim - k
    index = [_windows(n, int(o)) for n, o in zip(sizes, output_size, strict=True)]
    win = x
    for axis, idx in enumerate(index):  # each spatial axis becomes (out, window)
        win = jnp.take(win, jnp.asarray(idx), axis=lead + 2 * axis)
    outs = [lead + 2 * a for a in range(k)]
    inner = [lead + 2 * a + 1 for a in range(k)]
    win = jnp.transpose(win, (*range(lead), *outs, *inner))
    win = win.reshape(*win.shape[: lead + k], -1)
    strides = [math.prod(sizes[a + 1 :]) for a in range(k)]
    flat = np.zeros([len(i) for i in index] + [i.shape[1] for i in index], np.int64)
    for a, idx in enumerate(index):  # the flat input position of each window element
        shape = [1] * (2 * k)
        shape[a], shape[k + a] = idx.shape
        flat = flat + idx.reshape(shape) * strides[a]
    positions = jnp.asarray(flat.reshape(*flat.shape[:k], -1), jnp.int32)
    pos = _first_max(win)[..., None]
    values = jnp.take_along_axis(win, pos, axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(positions, win.shape), pos, axis=-1)[..., 0]
    return values, indices


def _cumulative(x: jax.Array, dim: int, later_wins: Callable[..., Any]) -> Any:
    """``(values, indices)`` of a cumulative extreme along ``dim``: the values gathered at
    the indices, so the gradient goes to the chosen element only (torch's scatter-add)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    axis = dim % x.ndim
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    idx = jnp.broadcast_to(jnp.arange(x.shape[axis], dtype=jnp.int32).reshape(shape), x.shape)
    floating = jnp.issubdtype(x.dtype, jnp.floating)

    def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> Any:
        (v1, i1), (v2, i2) = a, b
        take = later_wins(v1, v2)
        if floating:  # NaN wins, the last one: torch's ``isnan(x) || (!isnan(out) && ...)``
            take = jnp.isnan(v2) | (~jnp.isnan(v1) & take)
        return jnp.where(take, v2, v1), jnp.where(take, i2, i1)

    _, indices = jax.lax.associative_scan(combine, (jax.lax.stop_gradient(x), idx), axis=axis)
    return jnp.take_along_axis(x, indices, axis=axis), indices


def cummax(x: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """``torch.cummax``: the index of the *last* maximum so far, as torch's.

    Example:
        >>> v, i = cummax(jnp.array([1.0, 3.0, 3.0, 2.0]), -1)
        >>> v.tolist(), i.tolist()
        ([1.0, 3.0, 3.0, 3.0], [0, 1, 2, 2])
    """
    return _cumulative(x, dim, lambda v1, v2: v2 >= v1)


def cummin(x: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """``torch.cummin``: the index of the *last* minimum so far, as torch's.

    Example:
        >>> cummin(jnp.array([2.0, 1.0, 1.0, 3.0]), 0)[1].tolist()
        [0, 1, 2, 2]
    """
    return _cumulative(x, dim, lambda v1, v2: v2 <= v1)


def _rrelu(
    env: Any,
    x: jax.Array,
    lower: float = 0.125,
    upper: float = 1 / 3,
    training: bool = False,
    generator: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``(output, noise)`` of ``rrelu``: the slope of each element (1 where ``x > 0``)."""
    lower, upper = float(lower), float(upper)
    if not training:
        slope = jnp.asarray((lower + upper) / 2, x.dtype)
        return jnp.where(x > 0, x, x * slope), jnp.where(x > 0, 1, slope).astype(x.dtype)
    key = env.get_and_rotate_prng_key(generator)
    r = jax.random.uniform(key, x.shape, x.dtype, minval=lower, maxval=upper)
    noise = jnp.where(x <= 0, r, jnp.ones((), x.dtype))
    return x * noise, noise


def rrelu_with_noise(
    env: Any,
    x: Any,
    noise: Any,
    lower: float = 0.125,
    upper: float = 1 / 3,
    training: bool = False,
    generator: Any = None,
) -> Any:
    """``aten::rrelu_with_noise`` on torchax tensors: the output, ``noise`` written."""
    out, slopes = _rrelu(env, env.t2j_iso(x), lower, upper, training, generator)
    noise.copy_(env.j2t_iso(slopes))
    return env.j2t_iso(out)


def _random_(env: Any, kind: str, op: str | None = None) -> Callable[..., jax.Array]:
    """The functional of ``normal_``/``uniform_`` (``op``: the name the error gives, by
    default ``Tensor.normal_``/``Tensor.uniform_``): a draw of ``x``'s shape and dtype."""
    op = op or f"Tensor.{kind}_"

    first = 1.0 if kind == "exponential" else 0.0  # (exponential_'s lambd: 1)

    def draw(x: jax.Array, a: float = first, b: float = 1.0, *, generator: Any = None) -> Any:
        a, b = float(a), float(b)
        if kind == "normal" and b < 0:
            raise TorchModelError(
                f"{op}(mean={a}, std={b}) in {_module_site()}: torch needs std >= 0.0 (it "
                f"raises 'normal expects std >= 0.0, but found std {b:g}'). Fix: pass a "
                "non-negative std."
            )
        if kind == "uniform" and a > b:
            raise TorchModelError(
                f"{op}(from={a}, to={b}) in {_module_site()}: torch needs from <= to (it "
                "raises 'uniform_ expects to return a [from, to) range, but found "
                f"from={a:g} > to={b:g}'). Fix: swap the bounds ({op}(from={b}, to={a}))."
            )
        if kind == "exponential" and not a > 0:
            raise TorchModelError(
                f"{op}(lambd={a}) in {_module_site()}: torch needs lambd > 0 (it raises "
                f"'exponential_ expects lambda > 0.0, but found lambda={a:g}'). Fix: pass "
                "lambd > 0."
            )
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
        key = env.get_and_rotate_prng_key(generator)
        if kind == "exponential":  # (torch's draws are > 0: gumbel_softmax takes their log)
            value = jnp.maximum(jax.random.exponential(key, x.shape, dtype), jnp.finfo(dtype).tiny)
            value = value / a
        elif kind == "normal":
            value = jax.random.normal(key, x.shape, dtype) * b + a
        else:
            value = jax.random.uniform(key, x.shape, dtype, minval=a, maxval=b)
        return value.astype(x.dtype)

    return draw


def install_ops(env: Any) -> None:
    """Registers the lowerings above in a torchax environment (after its other lowerings:
    the dtype checks wrap whatever lowers each matmul and convolution)."""
    from torchax.ops import op_base, ops_registry

    aten = torch.ops.aten

    def put(op: Any, func: Any, *, jax_fn: bool, needs_env: bool, view: bool = False) -> None:
        env._ops[op] = ops_registry.Operator(
            op, func, is_jax_function=jax_fn, is_user_defined=True, needs_env=needs_env,
            is_view_op=view,
        )  # fmt: skip

    put(aten.adaptive_max_pool2d.default, adaptive_max_pool, jax_fn=True, needs_env=False)
    put(aten.adaptive_max_pool3d.default, adaptive_max_pool, jax_fn=True, needs_env=False)
    put(aten.cummax.default, cummax, jax_fn=True, needs_env=False)
    put(aten.cummin.default, cummin, jax_fn=True, needs_env=False)
    put(aten.rrelu_with_noise.default, functools.partial(rrelu_with_noise, env), jax_fn=False,
        needs_env=False)  # fmt: skip
    put(aten.rrelu_with_noise_functional.default,
        lambda x, noise, *args, **kwargs: _rrelu(env, x, *args, **kwargs), jax_fn=True,
        needs_env=False)  # fmt: skip
    # exponential_: torchax drew from a fixed key, the same numbers every step and call
    # (F.gumbel_softmax's noise); from the step's key here
    drawn = {aten.normal_.default: "normal", aten.uniform_.default: "uniform"}
    for op, kind in (drawn | {aten.exponential_.default: "exponential"}).items():
        inplace = op_base.InplaceOp(_random_(env, kind), is_jax_func=True)
        put(op, inplace, jax_fn=False, needs_env=False, view=True)
    # the functional op (``torch.ops.aten.uniform(x, a, b)``; ``uniform.out``): torchax's
    # own lowering asserted from <= to (a bare AssertionError); torch's checks here
    for uniform in (aten.uniform, aten.uniform.default):  # (torchax registers the packet)
        put(uniform, _random_(env, "uniform", "aten.uniform"), jax_fn=True, needs_env=False)
    install_dtype_checks(env, put)
