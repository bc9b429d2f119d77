"""Convolutions in a traced torch module (``torchshell.trace._conv``): patches + one matmul
where XLA:CPU's own convolution is slow, XLA's elsewhere; values and gradients equal torch's."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchshell.torch_model import torch_model_fns
from torchshell.trace._conv import PATCHES, XLA, conv_nd, conv_plan

RTOL = 1e-5  # of the tensor's largest magnitude, fp32


class Functional(nn.Module):
    """``F.conv1d/2d/3d`` with fixed keyword arguments (``padding="same"`` reaches the
    ``.padding`` overload, numbers the default one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, **kwargs: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[self.weight.ndim]
        return conv(x, self.weight, self.bias, **self.kwargs)


# (input shape, weight shape, keyword arguments, bias): each names what it exercises
CASES = {
    "1d_long_kernel_strided": ((2, 4, 40), (6, 4, 16), {"stride": 2, "padding": 7}, True),
    "1d_long_kernel_dilated_same": ((2, 4, 30), (6, 4, 12), {"padding": "same", "dilation": 2}, 1),
    "1d_short_kernel_xla": ((2, 8, 260), (6, 8, 3), {"padding": 1}, False),
    "1d_grouped_valid": ((2, 8, 12), (6, 4, 3), {"groups": 2, "padding": "valid"}, True),
    "2d_dense_3x3": ((2, 8, 9, 10), (6, 8, 3, 3), {"padding": 1}, True),
    "2d_dense_3x3_xla": ((2, 8, 16, 17), (6, 8, 3, 3), {"padding": 1, "dilation": 2}, True),
    "2d_depthwise_strided": (
        (2, 8, 9, 10),
        (8, 1, 3, 3),
        {"groups": 8, "stride": 2, "padding": 1},
        True,
    ),
    "2d_depthwise_multiplier": (
        (2, 4, 9, 10),
        (8, 1, 5, 5),
        {"groups": 4, "padding": (2, 1)},
        False,
    ),
    "2d_grouped_dilated": (
        (2, 8, 11, 10),
        (8, 2, 3, 3),
        {"groups": 4, "dilation": 2, "padding": 2},
        True,
    ),
    "2d_depthwise_7x7": ((2, 8, 12, 11), (8, 1, 7, 7), {"groups": 8, "padding": 3}, True),
    "2d_depthwise_dilated_strided_wide_pad": (
        (2, 8, 10, 9),
        (8, 1, 5, 3),
        {"groups": 8, "stride": (2, 3), "dilation": (2, 1), "padding": (4, 1)},
        False,
    ),
    "1d_depthwise_same_even_kernel": ((2, 6, 13), (6, 1, 4), {"groups": 6, "padding": "same"}, 1),
    "3d_depthwise_strided": ((2, 4, 5, 6, 7), (4, 1, 3, 3, 3), {"groups": 4, "stride": 2}, True),
    "2d_same_even_kernel": ((2, 3, 10, 11), (5, 3, 4, 2), {"padding": "same"}, True),  # asymmetric
    "2d_stem_strided": ((2, 3, 16, 16), (6, 3, 7, 7), {"stride": 2, "padding": 3}, False),
    "2d_1x1": ((2, 8, 5, 6), (12, 8, 1, 1), {}, True),
    "2d_unbatched": ((8, 9, 10), (8, 2, 3, 3), {"groups": 4, "padding": 1}, True),
    "3d_grouped": ((2, 4, 5, 6, 5), (4, 2, 3, 3, 3), {"groups": 2, "padding": 1}, True),
}


@contextmanager
def _torch_same_copy_note() -> Iterator[None]:
    """torch's own note on an asymmetric ``padding="same"`` (even kernel, odd dilation: it
    pads a copy of the input), which it gives once a process: that one message only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using padding='same' with even kernel")
        yield


def _lowered(module: nn.Module, x: torch.Tensor):
    fns = torch_model_fns(module, inputs=("x",))
    batch = {"x": jnp.asarray(x.numpy())}
    params, state = fns.init(jax.random.key(0), batch)

    def f(params: dict, x: jax.Array) -> jax.Array:
        return fns.apply(params, state, {"x": x}, jax.random.key(1), True)[0]

    return f, params, batch["x"]


def _close(got: jax.Array, want: torch.Tensor, what: str) -> None:
    want_np = want.detach().numpy()
    scale = max(float(np.abs(want_np).max()), 1e-6)
    err = float(np.abs(np.asarray(got) - want_np).max()) / scale
    assert err <= RTOL, f"{what}: max relative difference {err:.2e} > {RTOL}"


def _case(case: str) -> tuple[Functional, torch.Tensor]:
    x_shape, w_shape, kwargs, with_bias = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, generator=g)
    w = torch.randn(*w_shape, generator=g) * 0.3
    b = torch.randn(w_shape[0], generator=g) if with_bias else None
    return Functional(w, b, **kwargs), x


def _torch_grads(
    module: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """torch's output, parameter and input gradients of ``sum(out * cot)``; ``cot`` > 0 (a
    bias gradient sums it: no cancellation to make float noise look relative)."""
    xt = x.clone().requires_grad_(True)
    out = module(xt)
    cot = 1 + 0.5 * torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape)
    (out * cot).sum().backward()
    return out, {n: p.grad for n, p in module.named_parameters()}, xt.grad, cot


def _check(f, params: dict, xj: jax.Array, module: nn.Module, x: torch.Tensor, case: str) -> None:
    want, want_p, want_x, cot = _torch_grads(module, x)
    _close(f(params, xj), want, f"{case}: output")

    def loss(params: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(f(params, x) * jnp.asarray(cot.numpy()))

    grad_p, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, xj)
    _close(grad_x, want_x, f"{case}: input gradient")
    for name, g in want_p.items():
        _close(grad_p[name], g, f"{case}: {name} gradient")


@pytest.mark.parametrize("case", list(CASES))
def test_conv_lowering_values_and_gradients_equal_torch(case: str) -> None:
    """The lowering itself (``aten.conv1d/2d/3d``'s arguments), jitted, against torch."""
    module, x = _case(case)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in module.named_parameters()}

    def f(params: dict, x: jax.Array) -> jax.Array:
        return conv_nd(x, params["weight"], params.get("bias"), **module.kwargs)

    # torch warns of the copy it makes for an asymmetric "same" (even kernel, odd dilation)
    with _torch_same_copy_note():
        _check(f, params, jnp.asarray(x.numpy()), module, x, case)


@pytest.mark.parametrize(
    "case", ["1d_long_kernel_strided", "2d_depthwise_strided", "2d_depthwise_7x7", "2d_1x1"]
)
def test_traced_conv_modules_equal_torch(case: str) -> None:
    """Through ``torch_model_fns``: ``F.conv*d`` reaches the lowering and trains as torch."""
    module, x = _case(case)
    f, params, xj = _lowered(module, x)
    _check(f, params, xj, module, x, case)


def test_traced_nn_conv_with_same_padding_equals_torch() -> None:
    """``nn.Conv2d(padding="same")`` with an even kernel: torch pads one more on the right
    (and notes so itself, once a process)."""
    torch.manual_seed(0)
    module = nn.Conv2d(4, 6, (4, 3), padding="same", groups=2)
    x = torch.randn(2, 4, 7, 8)
    with _torch_same_copy_note():
        f, params, xj = _lowered(module, x)
        _check(f, params, xj, module, x, "same")


@pytest.mark.parametrize("groups", [1, 2])
def test_traced_conv_transpose_equals_torch(groups: int) -> None:
    """``nn.ConvTranspose2d``, grouped too (torchax 0.0.13 alone: 99% off at groups=2)."""
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups)
    x = torch.randn(2, 4, 5, 5)
    f, params, xj = _lowered(module, x)
    _check(f, params, xj, module, x, f"conv_transpose2d groups={groups}")


def _has_conv(module: nn.Module, x: torch.Tensor) -> bool:
    f, params, xj = _lowered(module, x)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: f(p, x).sum(), argnums=(0, 1)))(params, xj)
    return "conv_general_dilated" in str(jaxpr)


def test_grouped_and_long_1d_kernels_take_patches_dense_16x16_keeps_xla_on_cpu() -> None:
    assert jax.default_backend() == "cpu"
    # forward and both gradients: no XLA convolution at all where patches were chosen
    assert not _has_conv(nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.randn(2, 8, 6, 6))
    assert not _has_conv(nn.Conv1d(4, 8, 32, padding=16), torch.randn(2, 4, 40))
    assert _has_conv(nn.Conv2d(8, 8, 3, padding=1), torch.randn(2, 8, 16, 16))


def test_depthwise_input_gradient_is_one_correlation_not_a_pad_per_tap() -> None:
    """A depthwise 7x7's input gradient: ``g`` padded once and correlated with the flipped
    kernel, not autodiff's 49 padded copies of ``g`` summed (the ~10 ms of ConvNeXt's ~18 ms
    step on XLA:CPU, ``benchmarks/conv_cpu.py``); parity is the cases above."""
    module, x = _case("2d_depthwise_7x7")
    f, params, xj = _lowered(module, x)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: f(p, x).sum(), argnums=(0, 1)))(params, xj)
    pads = str(jaxpr).count(" pad[")  # the input's (the primal's and the forward's), g's
    assert pads <= 3, f"{pads} pads in the gradient's jaxpr (100 before: 2 a tap)"


def test_conv_plan_by_shape_and_backend() -> None:
    assert conv_plan((2, 250, 11), (2000, 250, 32), 1, backend="cpu") == PATCHES  # Wav2Letter
    assert conv_plan((2, 250, 11), (250, 250, 7), 1, backend="cpu") == PATCHES  # short output
    assert conv_plan((2, 250, 300), (250, 250, 7), 1, backend="cpu") == XLA
    assert conv_plan((2, 96, 16, 16), (96, 1, 5, 5), 96, backend="cpu") == PATCHES
    assert conv_plan((2, 3, 64, 64), (64, 3, 7, 7), 1, backend="cpu") == XLA  # an RGB stem
    assert conv_plan((2, 64, 16, 16), (128, 64, 1, 1), 1, backend="cpu") == PATCHES  # a matmul
    assert conv_plan((2, 64, 16, 16), (64, 64, 3, 3), 1, backend="cpu") == XLA
    assert conv_plan((2, 64, 32, 32), (64, 64, 3, 3), 1, stride=2, backend="cpu") == XLA
    assert conv_plan((2, 64, 16, 16), (64, 64, 3, 3), 1, stride=2, backend="cpu") == PATCHES
    assert conv_plan((2, 512, 2, 2), (512, 512, 3, 3), 1, backend="cpu") == PATCHES
    assert conv_plan((2, 96, 16, 16), (96, 1, 5, 5), 96, backend="gpu") == XLA  # cuDNN's own
