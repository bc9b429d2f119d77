"""Ops the trace computed differently from torch, silently (issue #52: torch's OpInfo
database through the trace): each op's value and gradient of ``(out * w).sum()``, traced
against torch eager, float32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns


class _Op(nn.Module):
    """``op(*params, *batch)``: the differentiable inputs are the module's parameters."""

    def __init__(self, op: Callable[..., Any], params: list[torch.Tensor]) -> None:
        super().__init__()
        self.op = op
        self.ps = nn.ParameterList([nn.Parameter(p.clone()) for p in params])

    def forward(self, *batch: torch.Tensor) -> Any:
        return self.op(*self.ps, *batch)


def _differences(
    op: Callable[..., Any],
    params: list[torch.Tensor],
    batch: tuple[torch.Tensor, ...] = (),
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> list[str]:
    """What differs between torch eager and the trace: the value, each parameter's grad."""
    net = _Op(op, params)
    out = net(*batch)
    w = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    (out * w).sum().backward()
    names = tuple(f"b{i}" for i in range(len(batch)))
    fns = torch_model_fns(net, names)
    fields = {k: jnp.asarray(v.numpy()) for k, v in zip(names, batch, strict=True)}
    init, state = fns.init(jax.random.key(0), fields)

    def loss(p: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        got = fns.apply(p, state, fields, jax.random.key(0), True)[0]
        return (got * jnp.asarray(w.numpy())).sum(), got

    (_, got), grads = jax.value_and_grad(loss, has_aux=True)(init)
    wrong = []
    want = out.detach().numpy()
    if not np.allclose(np.asarray(got), want, rtol=rtol, atol=atol, equal_nan=True):
        wrong.append(f"value {np.asarray(got)} != torch's {want}")
    for i, p in enumerate(net.ps):
        g, t = np.asarray(grads[f"ps.{i}"]), p.grad.numpy()
        if not np.allclose(g, t, rtol=rtol, atol=atol, equal_nan=True):
            wrong.append(f"gradient {i} {g} != torch's {t}")
    return wrong


_NEGATIVE = torch.tensor([-8.478, -2.3, -0.4, 0.3, 1.7, 5.2, -31.7])


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_polygamma_at_negative_inputs_equals_torch(n: int) -> None:
    """``jax.lax.polygamma(1, -8.478)`` is 7.739 (torch, scipy: 9.804): a JAX bug, worked
    around by the reflection formula below 1/2."""
    assert not _differences(lambda x: torch.polygamma(n, x), [_NEGATIVE])
    assert not _differences(lambda x: torch.special.polygamma(n, x), [_NEGATIVE])


def test_digamma_gradient_at_negative_inputs_equals_torch() -> None:
    assert not _differences(torch.digamma, [_NEGATIVE])
    assert not _differences(torch.special.psi, [_NEGATIVE])


def test_log_ndtr_far_in_the_left_tail_equals_torch() -> None:
    """torchax's decomposition: NaN gradient below about -7.9 (NaN value below -20)."""
    x = torch.tensor([-30.0, -20.0, -9.0, -7.9, -3.0, 0.0, 2.0, 9.0])
    assert not _differences(torch.special.log_ndtr, [x])


def test_safe_softmax_of_a_fully_masked_row_has_gradient_zero() -> None:
    """A row all ``-inf`` (a query no key may see): 0, and gradient 0 (was NaN)."""
    inf = float("-inf")
    mask = torch.tensor([[0.0, 0.0, 0.0], [inf, inf, inf], [0.0, inf, 0.0]])
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    assert not _differences(lambda a, m: torch.ops.aten._safe_softmax(a + m, -1), [x], (mask,))


@pytest.mark.parametrize("driver", [None, "gels", "gelsy", "gelsd", "gelss"])
def test_lstsq_values_and_gradients_equal_torch(driver: str | None) -> None:
    """``jnp.linalg.lstsq``'s gradients were ~1,000x less accurate than torch's (5.5e-3 on a
    well-conditioned 3x3): a QR solve (``gelsy``, torch's CPU default), an SVD (``gelsd``)."""
    g = torch.Generator().manual_seed(1)
    square = torch.tensor([[2.0, 0.5, 0.1], [0.3, 1.5, -0.2], [0.1, -0.4, 3.0]])
    tall = torch.randn(2, 5, 3, generator=g) + torch.eye(5, 3)
    wide = torch.randn(3, 5, generator=g)

    def solution(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.lstsq(a, b, driver=driver).solution

    assert not _differences(solution, [square, torch.randn(3, 2, generator=g)])
    assert not _differences(solution, [tall, torch.randn(2, 5, 2, generator=g)])
    if driver in (None, "gelsy", "gelsd", "gelss"):  # (gels: wide A needs full row rank)
        assert not _differences(solution, [wide, torch.randn(3, 2, generator=g)])
    if driver in ("gels", "gelsd", "gelss"):  # residuals (gelsy: none)

        def residuals(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.linalg.lstsq(a, b, driver=driver).residuals

        assert not _differences(residuals, [tall, torch.randn(2, 5, 2, generator=g)])


_BATCH_NORMS = ["native_batch_norm", "_native_batch_norm_legit"]


@pytest.mark.parametrize(
    ("name", "training"),
    [
        *((n, t) for n in _BATCH_NORMS for t in (False, True)),
        ("_native_batch_norm_legit_no_training", False),
    ],
)
def test_batch_norm_saved_statistics_have_torchs_shapes(name: str, training: bool) -> None:
    """Not training, torch's kernels save no mean/invstd (shape ``(0,)``); coreshell's
    override returned shape ``(C,)``."""
    op = getattr(torch.ops.aten, name)

    def call(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        mean, var = torch.zeros(3), torch.ones(3)
        if name.endswith("no_training"):
            return op(x, w, b, mean, var, 0.1, 1e-5)
        return op(x, w, b, mean, var, training, 0.1, 1e-5)

    class Stats(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
            out, saved_mean, saved_invstd = call(x, w, b)
            return out, torch.tensor(saved_mean.shape), torch.tensor(saved_invstd.shape)

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 4, generator=g), torch.rand(3, generator=g), torch.zeros(3)
    want = [t.shape for t in call(x, w, b)]
    fns = torch_model_fns(Stats(), ("x", "w", "b"))
    batch = {"x": jnp.asarray(x.numpy()), "w": jnp.asarray(w.numpy()), "b": jnp.zeros(3)}
    out, mean_shape, invstd_shape = fns.apply({}, {}, batch, jax.random.key(0), False)[0]
    got = [tuple(out.shape), tuple(np.asarray(mean_shape)), tuple(np.asarray(invstd_shape))]
    assert got == [tuple(s) for s in want]


def _fill_diagonal(a: torch.Tensor, value: float, wrap: bool = False) -> torch.Tensor:
    b = a.clone()
    b.fill_diagonal_(value, wrap=wrap)
    return b


def _nt_xent(z: torch.Tensor) -> torch.Tensor:
    """SimCLR's loss: the similarity of each view to itself masked with ``-inf``."""
    z = torch.nn.functional.normalize(z, dim=1)
    sim = z @ z.T / 0.5
    sim.fill_diagonal_(float("-inf"))
    n = z.shape[0] // 2
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return torch.nn.functional.cross_entropy(sim, target, reduction="none")


def _fill_slice(a: torch.Tensor) -> torch.Tensor:
    b = a.clone()
    b[1:].fill_diagonal_(0.0)
    return b


@pytest.mark.parametrize(
    ("name", "op", "shape"),
    [
        ("square", lambda a: _fill_diagonal(a, -2.0), (3, 4)),
        ("tall", lambda a: _fill_diagonal(a, 1.5), (7, 3)),
        ("tall wrapped", lambda a: _fill_diagonal(a, 1.5, wrap=True), (7, 3)),
        ("cube", lambda a: _fill_diagonal(a, 0.0), (3, 3, 3)),
        ("a slice", _fill_slice, (4, 3)),
        ("NT-Xent", _nt_xent, (6, 4)),
    ],
)
def test_fill_diagonal_writes_the_diagonal(name: str, op: Any, shape: tuple[int, ...]) -> None:
    """torchax 0.0.13 left the tensor unchanged (SimCLR's NT-Xent: 5.5008 for 5.4810)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert not _differences(op, [x])


@pytest.mark.parametrize(
    "to",
    [
        lambda a: a.to("cpu", torch.float64),
        lambda a: a.to(device="cpu", dtype=torch.float64),
        lambda a: a.to(torch.device("cpu"), torch.float16),
        lambda a: a.to("cpu"),
    ],
)
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")  # (JAX's x64 off)
def test_to_a_device_and_dtype_traces(to: Any) -> None:
    """``x.to("cpu", torch.float64)`` was refused as reading the weight as a Python number
    (torchax copied it to a torch CPU tensor); the device is JAX's, as for ``x.cpu()``."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    assert not _differences(lambda a: to(a * 2).float() * a, [x], rtol=1e-3)


@pytest.mark.parametrize(
    "take",
    [
        lambda a, i: torch.take_along_dim(a, i, 1),
        lambda a, i: torch.take_along_dim(a, i.long(), dim=-1),
        lambda a, i: a.take_along_dim(i[:1], 1),  # broadcast over rows
        lambda a, i: torch.take_along_dim(a, i),  # the flattened input
    ],
)
def test_take_along_dim_takes_batch_indices(take: Any) -> None:
    """int64 indices from the batch reach the step as int32: torch's check refused them
    ('indices should be Long but got Int'), and the suggested ``.long()`` did not help."""
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 2], [1, 0], [2, 2]])
    assert not _differences(take, [torch.randn(3, 3, generator=g)], (idx,))


def _in_place(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        b = a.clone()
        f(b, *rest)
        return b

    return run


_ZERO_D = torch.tensor(2.0), torch.tensor(3.0)


@pytest.mark.parametrize(
    ("op", "params"),
    [
        # on a 0-d tensor torch's decompositions wrote into a copy (the tensor unchanged)
        (_in_place(lambda b: b.index_fill_(0, torch.tensor(0), -1.0)), _ZERO_D[:1]),
        (_in_place(lambda b, s: b.index_copy_(0, torch.tensor([0]), s)), _ZERO_D),
        (_in_place(lambda b, s: b.index_add_(0, torch.tensor([0]), s, alpha=2)), _ZERO_D),
        # refused before: polygamma_ reached torchax's polygamma with its arguments swapped,
        # mvlgamma_ an op torchax has no lowering for
        (_in_place(lambda b: b.polygamma_(2)), (torch.tensor([0.5, -2.3, 4.0]),)),
        (_in_place(lambda b: b.mvlgamma_(3)), (torch.tensor([1.5, 2.3, 7.0]),)),
    ],
)
def test_in_place_ops_torchax_dropped_equal_torch(
    op: Any, params: tuple[torch.Tensor, ...]
) -> None:
    assert not _differences(op, list(params))


def test_cauchy_and_random_draw_from_the_step_key() -> None:
    """``cauchy_`` left the tensor unchanged; ``random_`` drew floats where torch draws
    integers in ``[from, to)``."""

    class Draws(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (
                x.clone().cauchy_(1.0, 2.0),
                x.clone().random_(3, 7),
                x.clone().random_(5),
                x.clone().random_(),
            )

    fns = torch_model_fns(Draws(), ("x",))
    batch = {"x": jnp.zeros(4000)}
    first, second = (
        [np.asarray(o) for o in fns.apply({}, {}, batch, jax.random.key(k), True)[0]]
        for k in (0, 1)
    )
    cauchy, between, below, any_ = first
    assert not np.allclose(cauchy, second[0])  # a new draw each step
    assert abs(np.median(cauchy) - 1.0) < 0.2  # median 1, half-width 2
    assert abs(np.quantile(cauchy, 0.75) - np.quantile(cauchy, 0.25) - 4.0) < 0.6
    assert set(np.unique(between)) == {3.0, 4.0, 5.0, 6.0}
    assert set(np.unique(below)) == {0.0, 1.0, 2.0, 3.0, 4.0}
    assert (any_ == np.round(any_)).all() and any_.min() >= 0 and any_.max() <= 2**24
    assert any_.max() > 2**23


@pytest.mark.parametrize(
    "resize",
    [
        lambda b: b.resize_(2, 3),
        lambda b: b.resize_((12,)),
        lambda b: b.resize_(torch.Size([4, 3])),
    ],
)
def test_resize_to_fewer_elements_equals_torch(resize: Any) -> None:
    """torchax kept the old shape (``resize_`` of (5, 5, 5) to (25, 5): unchanged)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    assert not _differences(lambda a: resize(a.detach().clone()) * a.sum(), [x])


def test_resize_to_more_elements_is_refused() -> None:
    class Grow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone().resize_(4, 4)

    fns = torch_model_fns(Grow(), ("x",))
    with pytest.raises(TorchModelError, match=r"resize_\(4, 4\).*Fix:"):
        fns.apply({}, {}, {"x": jnp.zeros((3, 4))}, jax.random.key(0), True)


def _out(f: Callable[..., Any], *shape: int) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        o = torch.zeros(*(shape or a.shape))
        f(a, c, o)
        return o

    return run


@pytest.mark.parametrize(
    "op",
    [
        _out(lambda a, c, o: torch.exp(a, out=o)),
        _out(lambda a, c, o: torch.matmul(a, c.T, out=o), 2, 2),
        _out(lambda a, c, o: torch.cumsum(a, 1, out=o)),
        _out(lambda a, c, o: torch.where(a > 0, a, c, out=o)),
        _out(lambda a, c, o: torch.sum(a, 1, out=o), 2),
        _out(lambda a, c, o: torch.cat([a, c], out=o), 4, 3),
        _out(lambda a, c, o: torch.maximum(a, c, out=o)),
        _out(lambda a, c, o: torch.polygamma(1, a, out=o)),
        _out(lambda a, c, o: torch.exp(a, out=o), 0),  # out resized, as torch does
        _out(lambda a, c, o: torch.exp(a[:, :2], out=o[:, :2])),  # into a slice
        _out(lambda a, c, o: torch.sort(a, 1, out=(o, torch.zeros(2, 3, dtype=torch.long)))),
        # torch functions whose decomposition wrote into a reshape of out (dropped, silently)
        _out(lambda a, c, o: torch.kron(a, c, out=o), 4, 9),
        _out(lambda a, c, o: torch.linalg.multi_dot([a, c.T, a], out=o)),
        _out(lambda a, c, o: torch.linalg.matrix_power(a @ c.T, 3, out=o), 2, 2),
        _out(lambda a, c, o: torch.unbind_copy(a, out=[o[0], o[1]])),  # (a list of outs)
    ],
)
def test_out_forms_write_the_result(op: Any) -> None:
    """``torch.exp(a, out=o)``: torchax passed ``out=`` to lowerings taking none (refused op
    by op); the functional op's result is written into ``o`` (values: torch does not
    differentiate ``out=`` forms)."""
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)

    class Out(nn.Module):
        def forward(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return op(a, c)

    want = op(a, c)
    fns = torch_model_fns(Out(), ("a", "c"))
    batch = {"a": jnp.asarray(a.numpy()), "c": jnp.asarray(c.numpy())}
    got = np.asarray(fns.apply({}, {}, batch, jax.random.key(0), True)[0])
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def _copied(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor) -> torch.Tensor:
        o = torch.zeros(2, 3)
        f(o, a)
        return o * 2

    return run


@pytest.mark.parametrize(
    "copy",
    [
        _copied(lambda o, a: o.copy_(a[1])),  # a row into every row (torchax: o became (3,))
        _copied(lambda o, a: o.copy_(a[:, 1:2])),  # a column (a view source: was refused)
        _copied(lambda o, a: o[:, 2:].copy_(a[:, 2:])),  # view into view (was refused)
        _copied(lambda o, a: o[1:].copy_(a[0])),
    ],
)
def test_copy_broadcasts_its_source(copy: Any) -> None:
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    assert not _differences(copy, [x])
