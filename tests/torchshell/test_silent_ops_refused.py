"""Ops the op database sweep found refused with a fix that could not be followed (issue #52):
``torch.normal(mean, std, size)`` of two numbers, ``torch.lu_unpack``,
``torch.linalg.householder_product``, ``torch.ormqr``, ``torch.segment_reduce`` (lengths
or offsets, traced too), antialiased bilinear ``F.interpolate`` and
``aten.max_pool2d_with_indices_backward``. Now lowered (``torchshell/trace/_refused.py``):
values and every gradient against torch eager; the draw from the step's key, new with each
key. The ops still refused (``eig``/``eigvals``, ``chalf``, fractional max pooling,
``to_sparse``) name a rewrite (``trace/_op_fixes.py``), and the rewrite traces and equals
torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.torchshell.test_silent_ops import _differences
from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns

_G = torch.Generator().manual_seed(3)
_TALL = torch.randn(6, 4, generator=_G)
_BATCH = torch.randn(2, 5, 5, generator=_G)
_TAU = torch.rand(4, generator=_G) + 0.5
_TAUS = torch.rand(2, 5, generator=_G) + 0.5


def _lu_unpack(a: torch.Tensor) -> torch.Tensor:
    """``P @ (L * 2) + U`` weights each factor of ``a``'s LU differently (its own pivots)."""
    lu, piv = torch.linalg.lu_factor(a.detach())
    lu = lu + (a - a.detach())  # (the gradient reaches a through the factors' entries)
    p, low, up = torch.lu_unpack(lu, piv)
    return torch.cat([(p @ low).flatten(), (low * 2).flatten(), up.flatten()])


@pytest.mark.parametrize(
    "matrix",
    [_TALL, _TALL.T.contiguous(), _BATCH],
    ids=["tall", "wide", "batch"],
)
def test_lu_unpack_equals_torch(matrix: torch.Tensor) -> None:
    assert not _differences(_lu_unpack, [matrix])


def test_lu_unpack_of_pivots_given_as_a_batch_field() -> None:
    lu, piv = torch.linalg.lu_factor(_BATCH)
    op = lambda a, p: torch.cat([t.flatten() for t in torch.lu_unpack(a, p)])  # noqa: E731
    assert not _differences(op, [lu], (piv,))


@pytest.mark.parametrize(
    ("a", "tau"), [(_TALL, _TAU), (_BATCH, _TAUS), (_TALL, _TAU[:2])], ids=["tall", "batch", "k"]
)
def test_householder_product_equals_torch(a: torch.Tensor, tau: torch.Tensor) -> None:
    assert not _differences(torch.linalg.householder_product, [a, tau])


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_ormqr_equals_torch(left: bool, transpose: bool) -> None:
    other = torch.randn(6, 3, generator=_G) if left else torch.randn(3, 6, generator=_G)
    op = lambda a, t, c: torch.ormqr(a, t, c, left=left, transpose=transpose)  # noqa: E731
    assert not _differences(op, [_TALL, _TAU, other])


_DATA = torch.tensor([[1.0, 2], [3, 0], [3, 5], [-1, 5], [0.5, 2], [4, 4]])


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


_SEGMENTS: dict[str, Callable[..., torch.Tensor]] = {
    f"{reduce}_{given}_{initial}": (
        lambda x, n, r=reduce, g=given, i=initial: (
            torch.segment_reduce(x, r, lengths=n, initial=i)
            if g == "lengths"
            else torch.segment_reduce(x, r, offsets=_offsets(n), initial=i)
        )
    )
    for reduce in ("sum", "mean", "max", "min")
    for given in ("lengths", "offsets")
    for initial in (None, 3.5)
}


@pytest.mark.parametrize("form", sorted(_SEGMENTS))
def test_segment_reduce_equals_torch(form: str) -> None:
    """Ties (3 and 3, 5 and 5) split their gradient as torch's; an empty segment gives
    ``initial``; the lengths are a batch field (traced)."""
    empty = not form.endswith("None")  # (without initial torch gives it -inf, inf or NaN)
    lengths = torch.tensor([1, 3, 0, 2] if empty else [1, 3, 2])
    assert not _differences(_SEGMENTS[form], [_DATA], (lengths,))


def test_normal_of_two_numbers_draws_from_the_steps_key() -> None:
    class Draw(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.normal(1.5, 0.25, (400,), dtype=torch.float32)

    fns = torch_model_fns(Draw(), ("x",))
    run: Any = lambda k: np.asarray(  # noqa: E731
        fns.apply({}, {}, {"x": jnp.zeros(())}, jax.random.key(k), True)[0]
    )
    one, two = run(0), run(1)
    assert one.shape == (400,) and one.dtype == np.float32
    assert not np.allclose(one, two)
    assert abs(one.mean() - 1.5) < 0.1 and abs(one.std() - 0.25) < 0.05


_IMAGES = torch.randn(2, 3, 10, 14, generator=_G)
_RESIZES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "down": lambda x: F.interpolate(x, size=(3, 5), mode="bilinear", antialias=True),
    "up": lambda x: F.interpolate(x, size=(13, 20), mode="bilinear", antialias=True),
    "mixed": lambda x: F.interpolate(x, size=(4, 21), mode="bilinear", antialias=True),
    "scale": lambda x: F.interpolate(x, scale_factor=0.4, mode="bilinear", antialias=True),
    "scale_2": lambda x: F.interpolate(x, scale_factor=(0.3, 0.5), mode="bilinear", antialias=True),
    "aten": lambda x: torch.ops.aten._upsample_bilinear2d_aa(x, [4, 6], False),
}


@pytest.mark.parametrize("form", sorted(_RESIZES))
def test_antialiased_bilinear_interpolation_equals_torch(form: str) -> None:
    assert not _differences(_RESIZES[form], [_IMAGES])


def test_antialiased_with_align_corners_is_refused_with_a_fix_that_traces() -> None:
    """torch's antialiased ``align_corners=True`` is not JAX's filter: refused, naming the
    fix (``align_corners=False``, or ``antialias=False``), and each fix equals torch."""

    class Resize(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.interpolate(
                x, size=(3, 5), mode="bilinear", align_corners=True, antialias=True
            )

    fns = torch_model_fns(Resize(), ("x",))
    with pytest.raises(TorchModelError, match=r"align_corners=True.*pass align_corners=False"):
        fns.apply({}, {}, {"x": jnp.asarray(_IMAGES.numpy())}, jax.random.key(0), True)
    for fixed in (
        lambda x: F.interpolate(
            x, size=(3, 5), mode="bilinear", align_corners=False, antialias=True
        ),
        lambda x: F.interpolate(x, size=(3, 5), mode="bilinear", align_corners=True),
    ):
        assert not _differences(fixed, [_IMAGES])


_SQUARE = torch.randn(4, 4, generator=_G)
_POOLED = torch.randn(1, 2, 6, 6, generator=_G)
# each refusal: what torch's op database calls, the message it must give, the fix it names
_REFUSALS: dict[str, tuple[Callable[..., Any], str, Callable[..., Any], torch.Tensor]] = {
    "eigvals": (
        lambda a: torch.linalg.eigvals(a).real,
        r"`aten::linalg_eig`.*Fix: for a symmetric \(Hermitian\) matrix call torch.linalg.eigh",
        torch.linalg.eigvalsh,
        _SQUARE + _SQUARE.T,
    ),
    "eig": (
        lambda a: torch.linalg.eig(a)[0].real,
        r"`aten::linalg_eig`.*Fix: for a symmetric",
        lambda a: torch.linalg.eigh(a)[0],
        _SQUARE + _SQUARE.T,
    ),
    "chalf": (
        lambda x: torch.view_as_real(x.chalf()).float(),
        r"JAX has no complex32.*Fix: use complex64 \(x.to\(torch.complex64\), x.cfloat\(\)\)",
        lambda x: torch.view_as_real(x.cfloat()),
        _SQUARE,
    ),
    "fractional_max_pool2d": (
        lambda x: F.fractional_max_pool2d(x, 2, output_size=3),
        r"`aten::fractional_max_pool2d`.*Fix: pool with fixed windows instead: "
        r"F.adaptive_max_pool2d\(x, output_size\)",
        lambda x: F.adaptive_max_pool2d(x, 3),
        _POOLED,
    ),
    "fractional_max_pool3d": (
        lambda x: F.fractional_max_pool3d(x, 2, output_size=3),
        r"`aten::fractional_max_pool3d`.*F.adaptive_max_pool3d\(x, output_size\)",
        lambda x: F.adaptive_max_pool3d(x, 3),
        torch.randn(1, 2, 6, 6, 6, generator=_G),
    ),
    "to_sparse": (
        lambda x: torch.sparse.mm(x.to_sparse(), x),
        r"`aten::_to_sparse`.*Fix: keep the tensor dense .*torch.sparse.mm\(a, b\) of dense "
        r"tensors is a @ b",
        lambda x: x @ x,
        _SQUARE,
    ),
}


# (torch eager's own note when x.chalf() makes a complex32 tensor)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("name", sorted(_REFUSALS))
def test_a_refusal_names_the_op_and_a_fix_that_traces(name: str) -> None:
    """Refused (no JAX lowering with torch's values and gradients), naming the op and a
    rewrite; the rewrite traces and equals torch, values and gradients."""
    refused, message, fixed, x = _REFUSALS[name]
    with pytest.raises(TorchModelError, match=message):
        _differences(refused, [x])
    assert not _differences(fixed, [x])


@pytest.mark.parametrize("pairs", [False, True])
def test_max_pool_backward_called_as_an_op_equals_torch(pairs: bool) -> None:
    """op_db's own call (single ints, ``ceil_mode``: torchax refused it) and pairs (torchax
    gave every element the first gradient, silently)."""
    x = torch.randn(2, 2, 5, 6, generator=_G)
    out, idx = F.max_pool2d(x, 3, 2, ceil_mode=True, return_indices=True)
    grad = torch.randn(out.shape, generator=_G)
    pool = ([3, 3], [2, 2], [0, 0], [1, 1]) if pairs else (3, 2, 0, 1)

    def backward(g: torch.Tensor, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.max_pool2d_with_indices_backward(g, x, *pool, True, i)

    assert not _differences(backward, [grad], (x, idx))
