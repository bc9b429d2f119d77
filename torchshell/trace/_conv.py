"""Convolutions in a traced step, lowered for what XLA:CPU does fast.

torchax 0.0.13 lowers every ``aten.convolution`` to one ``lax.conv_general_dilated`` in NCHW.
On a GPU that is cuDNN's kernel and right. On XLA:CPU three kinds of convolution are slow
(measured in ``benchmarks/conv_cpu.py``, forward + both gradients, fp32):

- **grouped and depthwise** (``groups > 1``): XLA:CPU rewrites a grouped convolution into a
  dense one with a block-diagonal kernel, ``groups`` times the work (ResNeXt's 32 groups:
  ~1.5 s against ~5 ms; a depthwise 5x5, stride 2: ~176 ms against ~32-50 ms);
- **large 1-D kernels** (torchaudio's Wav2Letter, kernel 32 over 250 -> 2,000 channels:
  ~4.6 s against ~0.25 s);
- **small outputs with many channels**, dense ones too (ResNet's last stage, 512 channels
  over 2x2: ~580 ms against ~5 ms), and 1x1 convolutions (2,000 -> 2,000 channels over 12
  steps: ~306 ms against ~94 ms).

Those are lowered here as *patches* (im2col from strided slices: the kernel's taps stacked
on a new axis) and one ``einsum`` over (channel, tap): a matmul, XLA:CPU's fastest op, whose
gradients are matmuls and pads. A depthwise kernel (one input channel per group) is the
taps multiplied and summed elementwise, with its own gradient: the input's is one more such
sum over the output gradient (dilated by the stride, padded, the kernel flipped), not
autodiff's one padded copy per tap (ConvNeXt's 7x7: 49 full-size copies summed, more than
half its step; 0.8 -> 0.36 ms for a 7x7 over 16 channels at 16x16, forward and backward).
Dense convolutions over large outputs (16x16 and up), and every convolution on another
backend, keep XLA's own convolution. Transposed convolutions stay XLA's (input dilation),
with a grouped one's kernel rearranged right (torchax 0.0.13's is wrong for groups > 1).

:func:`convolution` takes ``aten.convolution``'s arguments; :func:`conv_nd` takes
``aten.conv1d/2d/3d``'s, including ``padding="same"`` / ``"valid"`` (torch pads "same"
asymmetrically when the kernel's extent is even: one more on the right).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torchshell._errors import TorchModelError

__all__ = ["conv_lowerings", "conv_nd", "conv_plan", "convolution"]

PATCHES, XLA = "patches", "xla"
# a 1-D kernel at least this long goes through patches at any output length (Wav2Letter's 32)
LONG_KERNEL_1D = 11
# a dense convolution with at least this many output positions (16x16) stays XLA's
LARGE_OUTPUT = 256


def conv_plan(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    groups: int,
    stride: Sequence[int] | int = 1,
    backend: str | None = None,
) -> str:
    """How a convolution of these (static) shapes is lowered: ``"patches"`` or ``"xla"``.

    On CPU everything is patches but a dense (``groups=1``) convolution with a kernel wider
    than 1 (a 1-D one shorter than :data:`LONG_KERNEL_1D`) and at least
    :data:`LARGE_OUTPUT` output positions, or with at most 4 input channels (an RGB stem):
    there XLA's own convolution is as fast or faster (measured,
    ``benchmarks/conv_cpu.py``), and a stem through patches fed ResNet's max-pool values
    that moved its SGD steps off torch's (5e-3 after one step; not yet understood).

    Args:
        input_shape: ``[N, C, *spatial]``.
        weight_shape: ``[O, C // groups, *kernel]``.
        groups: torch's ``groups``.
        stride: torch's ``stride`` (the output's size is about the input's over it).
        backend: JAX's backend (default: ``jax.default_backend()``); only ``"cpu"`` uses
            patches.

    Example:
        >>> conv_plan((2, 128, 16, 16), (128, 4, 3, 3), groups=32, backend="cpu")
        'patches'
        >>> conv_plan((2, 64, 16, 16), (64, 64, 3, 3), groups=1, backend="cpu")
        'xla'
        >>> conv_plan((2, 512, 2, 2), (512, 512, 3, 3), groups=1, backend="cpu")
        'patches'
        >>> conv_plan((2, 128, 16, 16), (128, 4, 3, 3), groups=32, backend="gpu")
        'xla'
    """
    if (backend or jax.default_backend()) != "cpu":
        return XLA
    kernel = tuple(weight_shape[2:])
    strides = _per_dim(stride, len(kernel), "stride")
    positions = math.prod(-(-n // s) for n, s in zip(input_shape[2:], strides, strict=True))
    dense_xla = (
        groups == 1
        and math.prod(kernel) > 1
        and not (len(kernel) == 1 and kernel[0] >= LONG_KERNEL_1D)
        and (positions >= LARGE_OUTPUT or weight_shape[1] <= 4)
    )
    return XLA if dense_xla else PATCHES


def convolution(
    input: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> jax.Array:
    """``aten.convolution`` (what ``nn.Conv1d/2d/3d`` reach): patches or XLA by shape.

    Example:
        >>> import torch, numpy as np
        >>> x, w = torch.randn(2, 8, 9), torch.randn(8, 2, 5)
        >>> y = convolution(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), None,
        ...                 [2], [1], [1], False, [0], 4)
        >>> want = torch.nn.functional.conv1d(x, w, stride=2, padding=1, groups=4)
        >>> bool(np.allclose(np.asarray(y), want.numpy(), atol=1e-5))
        True
    """
    nd = weight.ndim - 2
    if transposed:
        return _transposed(
            input, weight, bias, _per_dim(stride, nd, "stride"),
            _per_dim(padding, nd, "padding"), _per_dim(dilation, nd, "dilation"),
            _per_dim(output_padding, nd, "output_padding"), groups,
        )  # fmt: skip
    pads = [(p, p) for p in _per_dim(padding, nd, "padding")]
    return _conv(input, weight, bias, _per_dim(stride, nd, "stride"), pads,
                 _per_dim(dilation, nd, "dilation"), groups)  # fmt: skip


def conv_nd(
    input: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    stride: Sequence[int] | int = 1,
    padding: Sequence[int] | int | str = 0,
    dilation: Sequence[int] | int = 1,
    groups: int = 1,
) -> jax.Array:
    """``aten.conv1d/2d/3d`` (``F.conv2d`` and friends), ``padding`` also ``"same"``/``"valid"``.

    Example:
        >>> import torch, numpy as np
        >>> x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 5)
        >>> y = conv_nd(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), padding="same")
        >>> want = torch.nn.functional.conv2d(x, w, padding="same")
        >>> bool(np.allclose(np.asarray(y), want.numpy(), atol=1e-5))
        True
    """
    nd = weight.ndim - 2
    dil = _per_dim(dilation, nd, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":
            extent = [d * (k - 1) for d, k in zip(dil, weight.shape[2:], strict=True)]
            pads = [(e // 2, e - e // 2) for e in extent]
        else:
            raise TorchModelError(
                f"conv{nd}d: padding must be 'same', 'valid' or numbers; got {padding!r}. "
                "Fix: pass one of those, as torch accepts."
            )
    else:
        pads = [(p, p) for p in _per_dim(padding, nd, "padding")]
    return _conv(input, weight, bias, _per_dim(stride, nd, "stride"), pads, dil, groups)


def conv_lowerings() -> dict[Any, Callable[..., jax.Array]]:
    """The aten ops lowered here, for a torchax environment's op table.

    Example:
        >>> import torch
        >>> torch.ops.aten.convolution.default in conv_lowerings()
        True
    """
    import torch

    aten = torch.ops.aten
    ops: dict[Any, Callable[..., jax.Array]] = {aten.convolution.default: convolution}
    for name in ("conv1d", "conv2d", "conv3d"):
        ops[getattr(aten, name).default] = conv_nd
        ops[getattr(aten, name).padding] = conv_nd
    return ops


def _per_dim(value: Sequence[int] | int, nd: int, what: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 1:
        values = values * nd
    if len(values) != nd:
        raise TorchModelError(
            f"convolution: {what} needs 1 or {nd} values for a {nd}-D kernel, got {values}. "
            f"Fix: one {what} per spatial dimension."
        )
    return [int(v) for v in values]


def _conv(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None,
    stride: list[int],
    pads: list[tuple[int, int]],
    dilation: list[int],
    groups: int,
) -> jax.Array:
    nd = w.ndim - 2
    lead = x.shape[: x.ndim - nd - 1]  # () for an unbatched input, (N,) or more otherwise
    x = x.reshape((-1, *x.shape[x.ndim - nd - 1 :]))
    if x.shape[1] != w.shape[1] * groups:
        raise TorchModelError(
            f"convolution: the input has {x.shape[1]} channels, the weight {tuple(w.shape)} "
            f"with groups={groups} expects {w.shape[1] * groups}. Fix: match the module's "
            "in_channels."
        )
    if conv_plan(x.shape, w.shape, groups, stride) == PATCHES:
        y = _patches(x, w, stride, pads, dilation, groups)
    else:
        spec = "NC" + "DHW"[3 - nd :]
        numbers = lax.conv_dimension_numbers(x.shape, w.shape, (spec, "OI" + spec[2:], spec))
        y = lax.conv_general_dilated(
            x, w, stride, pads, rhs_dilation=dilation, dimension_numbers=numbers,
            feature_group_count=groups,
        )  # fmt: skip
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd).astype(y.dtype)
    return y.reshape((*lead, *y.shape[1:]))


def _patches(
    x: jax.Array,
    w: jax.Array,
    stride: list[int],
    pads: list[tuple[int, int]],
    dilation: list[int],
    groups: int,
) -> jax.Array:
    """The convolution as taps (strided slices of the padded input) and one contraction."""
    nd = w.ndim - 2
    kernel = w.shape[2:]
    xp = jnp.pad(x, [(0, 0), (0, 0), *pads])
    out = [
        (xp.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd)
    ]
    if min(out) <= 0:
        raise TorchModelError(
            f"convolution: the padded input {tuple(xp.shape[2:])} is smaller than the kernel "
            f"{tuple(kernel)} (dilation {dilation}). Fix: a longer input or more padding."
        )
    n, c = x.shape[:2]
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offset, dilation, strict=True)]
        limit = [s + (m - 1) * st + 1 for s, m, st in zip(start, out, stride, strict=True)]
        taps.append(lax.slice(xp, (0, 0, *start), (n, c, *limit), (1, 1, *stride)))
    n_taps, o = len(taps), w.shape[0]
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    cin, cout = c // groups, o // groups
    if cin == 1 and cout == 1:  # depthwise: taps times per-channel weights, summed
        return _depthwise(x, w, tuple(stride), tuple(pads), tuple(dilation))
    cols = jnp.stack(taps, axis=2).reshape((n, groups, cin, n_taps, *out))
    sp = "xyz"[:nd]
    y = jnp.einsum(
        f"ngck{sp},gock->ngo{sp}", cols, w.reshape((groups, cout, cin, n_taps)),
        preferred_element_type=acc,
    )  # fmt: skip
    return y.reshape((n, o, *out)).astype(x.dtype)


def _taps_sum(
    xp: jax.Array, w: jax.Array, out: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> jax.Array:
    """``sum_t slice_t(xp) * w[:, t]``: a depthwise correlation of the padded ``xp``."""
    nd, (n, c) = w.ndim - 2, xp.shape[:2]
    acc = jnp.float32 if xp.dtype in (jnp.bfloat16, jnp.float16) else xp.dtype
    wk = w.reshape((c, -1)).astype(acc)
    y = None
    for t, offset in enumerate(itertools.product(*(range(k) for k in w.shape[2:]))):
        start = [o * d for o, d in zip(offset, dilation, strict=True)]
        limit = [s + (m - 1) * st + 1 for s, m, st in zip(start, out, stride, strict=True)]
        tap = lax.slice(xp, (0, 0, *start), (n, c, *limit), (1, 1, *stride)).astype(acc)
        term = tap * wk[:, t].reshape((1, c) + (1,) * nd)
        y = term if y is None else y + term
    assert y is not None
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _depthwise_core(x: jax.Array, w: jax.Array, geometry: tuple) -> jax.Array:
    return _depthwise_fwd(x, w, geometry)[0]


def _depthwise_fwd(x: jax.Array, w: jax.Array, geometry: tuple) -> tuple:
    stride, pads, dilation = geometry
    out = _out_size(x.shape[2:], w.shape[2:], stride, pads, dilation)
    xp = jnp.pad(x, [(0, 0), (0, 0), *pads])
    return _taps_sum(xp, w, out, stride, dilation).astype(x.dtype), (xp, w)


def _depthwise_bwd(geometry: tuple, res: tuple, g: jax.Array) -> tuple:
    """The input's gradient as one more depthwise correlation (of ``g`` dilated by the stride
    and padded, under the flipped kernel) rather than autodiff's one padded copy of ``g`` per
    tap, summed (ConvNeXt's 7x7: 49 full-size pads, ~10 of its ~18 ms a step); the weight's
    as one contraction of the stacked taps with ``g`` (not 49 reductions, each recomputing
    the fusion that feeds the taps)."""
    stride, pads, dilation = geometry
    xp, w = res
    nd, kernel = w.ndim - 2, w.shape[2:]
    size = [n - lo - hi for n, (lo, hi) in zip(xp.shape[2:], pads, strict=True)]
    acc = jnp.float32 if g.dtype in (jnp.bfloat16, jnp.float16) else g.dtype
    n, c = xp.shape[:2]
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offset, dilation, strict=True)]
        limit = [b + (m - 1) * st + 1 for b, m, st in zip(start, g.shape[2:], stride, strict=True)]
        taps.append(lax.slice(xp, (0, 0, *start), (n, c, *limit), (1, 1, *stride)))
    sp = "xyz"[:nd]
    dw = jnp.einsum(f"nct{sp},nc{sp}->ct", jnp.stack(taps, axis=2), g, preferred_element_type=acc)
    spread = [
        (d * (k - 1) - lo, m - 1 + lo - (o - 1) * s, s - 1)
        for m, k, s, (lo, _), d, o in zip(
            size, kernel, stride, pads, dilation, g.shape[2:], strict=True
        )
    ]
    gp = lax.pad(g, jnp.zeros((), g.dtype), [(0, 0, 0), (0, 0, 0), *spread])
    flipped = jnp.flip(w, tuple(range(2, w.ndim)))
    dx = _taps_sum(gp, flipped, size, (1,) * nd, dilation)
    return dx.astype(xp.dtype), dw.reshape(w.shape).astype(w.dtype)


_depthwise_core.defvjp(_depthwise_fwd, _depthwise_bwd)


def _depthwise(
    x: jax.Array, w: jax.Array, stride: tuple, pads: tuple, dilation: tuple
) -> jax.Array:
    return _depthwise_core(x, w, (stride, pads, dilation))


def _out_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> list[int]:
    return [
        (n + lo + hi - d * (k - 1) - 1) // s + 1
        for n, k, s, (lo, hi), d in zip(size, kernel, stride, pads, dilation, strict=True)
    ]


def _transposed(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    output_padding: list[int],
    groups: int,
) -> jax.Array:
    """``ConvTranspose*d``: the input dilated by ``stride`` under the kernel flipped, its
    ``[in, out / groups]`` halves swapped per group (torchax 0.0.13 gets ``groups > 1``
    wrong: it reshapes the kernel without that swap)."""
    nd = w.ndim - 2
    lead = x.shape[: x.ndim - nd - 1]
    x = x.reshape((-1, *x.shape[x.ndim - nd - 1 :]))
    cin, cout, kernel = w.shape[0], w.shape[1], w.shape[2:]
    rhs = w.reshape((groups, cin // groups, cout, *kernel)).swapaxes(1, 2)
    rhs = jnp.flip(rhs.reshape((groups * cout, cin // groups, *kernel)), range(2, 2 + nd))
    pads = []
    for k, p, d, extra in zip(kernel, padding, dilation, output_padding, strict=True):
        front = d * (k - 1) - p
        pads.append((front, front + extra))
    spec = "NC" + "DHW"[3 - nd :]
    numbers = lax.conv_dimension_numbers(x.shape, rhs.shape, (spec, "OI" + spec[2:], spec))
    y = lax.conv_general_dilated(
        x, rhs, (1,) * nd, pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=numbers, feature_group_count=groups,
    )  # fmt: skip
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd).astype(y.dtype)
    return y.reshape((*lead, *y.shape[1:]))
