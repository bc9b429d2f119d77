"""``index_reduce`` / ``index_reduce_`` through the trace (issue #52): every mode, with and
without ``include_self``, on repeated indices, ties and zeros (where torch's gradient is its
own formula), functional, in place and in place through a slice: values and gradients equal
torch's. (torchax has no lowering: the trace stopped with coreshell's refusal.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.torchshell.test_silent_ops import _differences
from torchshell.torch_model import torch_model_fns

_SELF = torch.tensor(
    [[1.0, -2.0, 0.5], [3.0, 0.0, 2.0], [-1.0, 4.0, 4.0], [2.0, 2.0, -3.0], [0.7, 1.1, 0.0]]
)
# rows 0 and 2 take three and two source rows (a tie with self and within the source at
# [0, 1] and [2, 2]; zeros at [1, 1] and two at [3, 2], which go to row 0)
_SOURCE = torch.tensor(
    [[2.0, -2.0, 1.0], [0.5, 0.0, 4.0], [-1.0, 4.0, 6.0], [5.0, -2.0, 0.0], [1.5, 3.0, 0.0]]
)
_INDEX = torch.tensor([0, 2, 2, 0, 0])


def _functional(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.index_reduce(x, 0, i, s, mode, include_self=keep)

    return run


def _in_place(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        y.index_reduce_(0, i, s, mode, include_self=keep)
        return y

    return run


def _through_a_slice(mode: str, keep: bool) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        y = torch.cat([x, x]) * 1.0
        y[5:].index_reduce_(0, i, s, mode, include_self=keep)  # (the write reaches y)
        return y

    return run


@pytest.mark.filterwarnings(r"ignore:index_reduce\(\) is in beta")
@pytest.mark.parametrize("form", [_functional, _in_place, _through_a_slice])
@pytest.mark.parametrize("keep", [True, False], ids=["include_self", "exclude_self"])
@pytest.mark.parametrize("mode", ["prod", "mean", "amax", "amin"])
def test_index_reduce_equals_torch(mode: str, keep: bool, form: Any) -> None:
    assert not _differences(form(mode, keep), [_SELF, _SOURCE], (_INDEX,))


@pytest.mark.parametrize("mode", ["prod", "mean", "amax", "amin"])
def test_index_reduce_along_a_later_dim_equals_torch(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, s = torch.randn(2, 4, 3, generator=g), torch.randn(2, 6, 3, generator=g)
    index = torch.tensor([3, 1, 3, 0, 1, 3])

    def run(a: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return a.index_reduce(1, i, b, mode, include_self=mode != "mean")

    assert not _differences(run, [x, s], (index,))


@pytest.mark.parametrize("mode", ["prod", "mean", "amax", "amin"])
def test_index_reduce_of_integers_equals_torch(mode: str) -> None:
    # (a mean of integers rounds down, as torch's)
    x = torch.tensor([[7, -3], [2, 5], [-8, 1]])
    s = torch.tensor([[2, 9], [-5, 4], [3, 3], [1, -6]])
    index = torch.tensor([0, 2, 0, 2])

    class Net(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return a.index_reduce(0, i, b, mode, include_self=False)

    fns = torch_model_fns(Net(), ("a", "b", "i"))
    batch = {k: jnp.asarray(v.numpy()) for k, v in zip("abi", (x, s, index), strict=True)}
    params, state = fns.init(jax.random.key(0), batch)
    got = fns.apply(params, state, batch, jax.random.key(0), True)[0]
    want = Net()(x, s, index)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
