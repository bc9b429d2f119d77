"""``scatter_reduce`` / ``scatter_reduce_`` through the trace (issue #52): every mode, with and
without ``include_self``, on repeated indices, ties and zeros (where torch's gradient is its
own formula), along the first and a later dim, functional, in place and in place through a
slice: values and gradients equal torch's. torchax let JAX differentiate its scatters:
``prod`` stopped the trace (``scatter_mul`` has no gradient for repeated indices) and
``amax``/``amin`` without ``include_self`` gave each tied source element the whole gradient
(torch splits it), silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from tests.torchshell.test_silent_ops import _differences
from torchshell.torch_model import torch_model_fns

_MODES = ["sum", "prod", "mean", "amax", "amin"]
_SELF = torch.tensor(
    [[1.0, -2.0, 0.5], [3.0, 0.0, 2.0], [-1.0, 4.0, 4.0], [2.0, 2.0, -3.0], [0.7, 1.1, 0.0]]
)
# ties within the source and with self ([2, 1]: 4.0 twice into row 2, which holds 4.0), zeros
# ([1, 1] alone, two into [0, 2] and [4, 2]), and rows no index writes (3)
_SOURCE = torch.tensor(
    [[2.0, -2.0, 1.0], [0.5, 0.0, 4.0], [-1.0, 4.0, 6.0], [5.0, 4.0, 0.0], [1.5, 3.0, 0.0]]
)
_INDEX = torch.tensor([[0, 2, 2], [2, 0, 0], [2, 2, 0], [0, 2, 0], [0, 1, 4]])


def _functional(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.scatter_reduce(x, 0, i, s, mode, include_self=keep)

    return run


def _in_place(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        y.scatter_reduce_(0, i, s, mode, include_self=keep)
        return y

    return run


def _through_a_slice(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        y = torch.cat([x, x]) * 1.0
        y[5:].scatter_reduce_(0, i, s, mode, include_self=keep)  # (the write reaches y)
        return y

    return run


@pytest.mark.parametrize("form", [_functional, _in_place, _through_a_slice])
@pytest.mark.parametrize("keep", [True, False], ids=["include_self", "exclude_self"])
@pytest.mark.parametrize("mode", _MODES)
def test_scatter_reduce_equals_torch(mode: str, keep: bool, form: Any) -> None:
    assert not _differences(form(mode, keep), [_SELF, _SOURCE], (_INDEX,))


@pytest.mark.parametrize("keep", [True, False], ids=["include_self", "exclude_self"])
@pytest.mark.parametrize("mode", _MODES)
def test_scatter_reduce_along_a_later_dim_equals_torch(mode: str, keep: bool) -> None:
    """``index`` smaller than ``self`` (its extent is what is scattered), dim 1 of three."""
    g = torch.Generator().manual_seed(0)
    x, s = torch.randn(3, 4, 2, generator=g), torch.randn(2, 3, 2, generator=g)
    s[0, 1, 1] = s[1, 1, 1]  # (a tie into x[1, 1, 1]... and x[0, 1, 1])
    s[1, 2, 0] = 0.0
    index = torch.tensor([[[3, 1], [1, 1], [3, 0]], [[0, 3], [3, 1], [1, 0]]])

    def run(a: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return a.scatter_reduce(-2, i, b, mode, include_self=keep)

    assert not _differences(run, [x, s], (index,))


@pytest.mark.parametrize("keep", [True, False], ids=["include_self", "exclude_self"])
@pytest.mark.parametrize("mode", _MODES)
def test_scatter_reduce_values_of_integers_and_a_larger_source(mode: str, keep: bool) -> None:
    """Integers (a mean rounds down, as torch's), a source larger than ``index`` (torch reads
    ``index``'s extent of it), a 0-d tensor: values (torch differentiates none of these)."""
    cases = [
        (
            torch.tensor([[7, -3], [2, 5], [-8, 1]]),
            torch.tensor([[0, 2], [2, 2], [0, 0]]),
            torch.tensor([[2, 9], [-5, 4], [3, 3]]),
        ),
        (torch.randn(3, 4), torch.tensor([[2, 0], [1, 2]]), torch.randn(4, 5)),
        (torch.tensor(2.0), torch.tensor(0), torch.tensor(3.0)),
    ]

    class Net(nn.Module):
        def forward(self, x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return x.scatter_reduce(0, i, s, mode, include_self=keep)

    for x, index, s in cases:
        fns = torch_model_fns(Net(), ("x", "i", "s"))
        batch = {k: jnp.asarray(v.numpy()) for k, v in zip("xis", (x, index, s), strict=True)}
        got = fns.apply({}, {}, batch, jax.random.key(0), True)[0]
        np.testing.assert_allclose(np.asarray(got), Net()(x, index, s).numpy(), rtol=1e-6)
