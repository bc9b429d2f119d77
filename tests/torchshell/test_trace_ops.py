"""Ops that stopped a torch trace (or traced wrongly), and torch's dtype refusals.

Each op's values, indices and gradients traced against eager torch on CPU; each trains
through ``JaxModule.from_torch`` with a real ``lightning.Trainer``; a matmul or convolution
fed another dtype than its weights is refused at trace time as torch refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchshell import JaxModule
from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns


class _Op(nn.Module):
    def __init__(self, op: Callable[..., Any]) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> Any:
        return self.op(x)


def _traced(op: Callable[..., Any], x: torch.Tensor, train: bool = False, key: int = 0) -> Any:
    """``op(x)`` traced: its outputs and the VJP of its first output w.r.t. ``x``."""
    fns = torch_model_fns(_Op(op), ("x",))

    def run(x_: jax.Array) -> Any:
        return fns.apply({}, {}, {"x": x_}, jax.random.key(key), train)[0]

    out = run(jnp.asarray(x.numpy()))
    _, vjp = jax.vjp(lambda x_: _first(run(x_)), jnp.asarray(x.numpy()))
    return out, vjp


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _compare(name: str, op: Callable[..., Any], x: torch.Tensor) -> list[str]:
    """Values (and indices) and the gradient of the first output, traced vs torch."""
    leaf = x.clone().requires_grad_(True)
    want = op(leaf)
    first = _first(want)
    cot = torch.linspace(0.5, 1.5, first.numel()).reshape(first.shape)
    (grad,) = torch.autograd.grad((first * cot).sum(), leaf)
    got, vjp = _traced(op, x)
    (got_grad,) = vjp(jnp.asarray(cot.numpy()))
    wrong = []
    pairs = zip(got, want, strict=True) if isinstance(want, tuple) else [(got, want)]
    for g, w in pairs:
        w_ = w.detach().numpy()
        if np.asarray(g).shape != w_.shape or not np.allclose(
            np.asarray(g), w_, rtol=1e-5, atol=1e-6, equal_nan=True
        ):
            wrong.append(f"{name}: {np.asarray(g).tolist()} != {w_.tolist()}")
    if not np.allclose(np.asarray(got_grad), grad.numpy(), rtol=1e-5, atol=1e-6):
        wrong.append(f"{name} (gradient): {np.asarray(got_grad)} != {grad.numpy()}")
    return wrong


def _ties(*shape: int) -> torch.Tensor:
    """Small integers as floats: many exact ties (the index rules and the gradient there)."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(0)).float()


def test_adaptive_max_pooling_equals_torch_values_indices_and_gradients() -> None:
    """``aten::adaptive_max_pool2d`` had no lowering (``nn.AdaptiveMaxPool1d`` stopped the
    trace). Windows of unequal sizes (11 -> 4), ties (the first maximum and its gradient),
    a NaN (torch keeps the last one), 1d/2d/3d, with and without ``return_indices``."""
    g = torch.Generator().manual_seed(1)
    x3, x4, x5 = torch.randn(2, 3, 11, generator=g), _ties(2, 3, 7, 9), _ties(1, 2, 5, 6, 7)
    nan = torch.tensor([[[1.0, float("nan"), 2.0, float("nan"), 0.5, 3.0]]])
    cases: dict[str, tuple[Callable[..., Any], torch.Tensor]] = {
        "1d": (lambda x: F.adaptive_max_pool1d(x, 4), x3),
        "1d_indices": (lambda x: F.adaptive_max_pool1d(x, 5, return_indices=True), x3),
        "1d_module_unbatched": (nn.AdaptiveMaxPool1d(3, return_indices=True), x3[0]),
        "1d_ties": (lambda x: F.adaptive_max_pool1d(x.flatten(2), 6, True), x4),
        "1d_nan": (lambda x: F.adaptive_max_pool1d(x, 2, True), nan),
        "2d": (lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True), x4),
        "2d_identity": (lambda x: F.adaptive_max_pool2d(x, (7, 9), True), x4),
        "2d_global": (nn.AdaptiveMaxPool2d(1), x4),
        "2d_none": (lambda x: F.adaptive_max_pool2d(x, (None, 2), True), x4),
        "3d": (lambda x: F.adaptive_max_pool3d(x, (2, 4, 3), True), x5),
    }
    wrong = [w for name, (op, x) in cases.items() for w in _compare(name, op, x)]
    assert not wrong, "\n".join(wrong)


def test_cummax_cummin_equal_torch_on_each_dim() -> None:
    """torchax's lowering failed on a negative dim and split the gradient between ties
    (``jnp.maximum``); torch's index is the last extreme (NaN wins) and its gradient goes
    there only."""
    row = torch.tensor([[1.0, 3.0, 3.0, 2.0, 5.0, 5.0, 0.0, -1.0, 5.0, 4.0, 6.0, 6.0]])
    btc = _ties(2, 5, 4)
    nan = torch.tensor([[1.0, float("nan"), 3.0, float("nan"), 0.0, 7.0]])
    wrong = []
    for fn in (torch.cummax, torch.cummin):
        for x, dims in ((row, (0, 1, -1)), (btc, (0, 1, 2, -1, -2, -3)), (nan, (1,))):
            for d in dims:
                name = f"{fn.__name__} {list(x.shape)} dim={d}"
                wrong += _compare(name, lambda x, fn=fn, d=d: tuple(fn(x, d)), x)
    assert not wrong, "\n".join(wrong)


def test_rrelu_in_eval_is_leaky_relu_with_the_mean_slope() -> None:
    """``aten::rrelu_with_noise`` had no lowering (``nn.RReLU``, ``F.rrelu``)."""
    x = torch.cat([_ties(4, 6), torch.randn(4, 6, generator=torch.Generator().manual_seed(2))])
    cases: dict[str, Callable[..., Any]] = {
        "F.rrelu": lambda x: F.rrelu(x, training=False),
        "bounds": lambda x: F.rrelu(x, 0.1, 0.4, training=False),
        "module": nn.RReLU(0.2, 0.3).eval(),
        "inplace": lambda x: F.rrelu(x * 1.0, 0.1, 0.3, inplace=True),
    }
    wrong = [w for name, op in cases.items() for w in _compare(name, op, x)]
    assert not wrong, "\n".join(wrong)


def test_rrelu_in_training_draws_a_slope_per_element_from_the_step_key() -> None:
    """Training: ``x`` where ``x > 0``, ``x * r`` with ``r ~ U(lower, upper)`` elsewhere, a
    new draw per step key (as dropout's), and the gradient is that slope (torch's
    ``grad * noise``)."""
    x = -torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) - 0.1
    x[:, :8] *= -1.0  # positives pass unchanged
    lower, upper = 0.1, 0.3

    def op(t: torch.Tensor) -> torch.Tensor:
        return F.rrelu(t, lower, upper, training=True)

    out, vjp = _traced(op, x, train=True, key=1)
    again, _ = _traced(op, x, train=True, key=1)
    other, _ = _traced(op, x, train=True, key=2)
    (grad,) = vjp(jnp.ones(x.shape))
    slope = np.asarray(out) / x.numpy()
    np.testing.assert_array_equal(np.asarray(out)[:, :8], x.numpy()[:, :8])
    neg = slope[:, 8:]
    assert lower <= neg.min() and neg.max() <= upper
    assert abs(neg.mean() - (lower + upper) / 2) < 0.01  # uniform: mean 0.2, sd 0.06/sqrt(3584)
    assert abs(neg.std() - (upper - lower) / 12**0.5) < 0.01
    np.testing.assert_allclose(np.asarray(grad), slope, rtol=1e-5)  # d(x * r)/dx = r
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    assert (np.asarray(out) != np.asarray(other))[:, 8:].mean() > 0.99
    want = op(x)  # torch's draw: the same law
    torch_slope = (want / x).numpy()[:, 8:]
    assert abs(torch_slope.mean() - neg.mean()) < 0.01


def test_normal_and_uniform_in_a_forward_draw_from_the_step_key() -> None:
    """``torch.empty_like(x).normal_(0, 0.1)`` (noise injection) failed to match any
    ``aten::normal`` schema in torchax; now both draws come from the step's key, in the
    tensor's dtype, with the gradient of ``x + noise`` w.r.t. ``x`` the identity."""
    x = torch.zeros(64, 64)

    def noisy(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = t + torch.empty_like(t).normal_(1.0, 0.1)
        u = t + torch.empty_like(t).uniform_(-0.5, 0.25)
        return n, u

    (n, u), vjp = _traced(noisy, x, train=True, key=1)
    (n2, u2), _ = _traced(noisy, x, train=True, key=1)
    (n3, _), _ = _traced(noisy, x, train=True, key=2)
    (grad,) = vjp(jnp.ones(x.shape))
    n, u = np.asarray(n), np.asarray(u)
    assert abs(n.mean() - 1.0) < 0.01 and abs(n.std() - 0.1) < 0.01
    assert u.min() >= -0.5 and u.max() <= 0.25 and abs(u.mean() + 0.125) < 0.01
    assert abs(u.std() - 0.75 / 12**0.5) < 0.01
    np.testing.assert_array_equal(n, np.asarray(n2))
    np.testing.assert_array_equal(u, np.asarray(u2))
    assert (n != np.asarray(n3)).mean() > 0.99
    np.testing.assert_array_equal(np.asarray(grad), np.ones(x.shape))
    half, _ = _traced(lambda t: t.bfloat16().normal_(0.0, 1.0), x, train=True)
    assert half.dtype == jnp.bfloat16 and abs(float(np.asarray(half, np.float32).std()) - 1) < 0.05
    with pytest.raises(TorchModelError, match=r"std >= 0\.0"):
        _traced(lambda t: torch.empty_like(t).normal_(0.0, -1.0), x)


class _Net(nn.Module):
    """A Linear, then an op under test, then a Linear to the classes."""

    def __init__(self, op: Callable[..., Any]) -> None:
        super().__init__()
        self.inp, self.op, self.out = nn.Linear(12, 24), op, nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.op(self.inp(x)))


def _fit(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Any = None, precision: str = "32-true"
) -> JaxModule:
    module = JaxModule.from_torch(
        net,
        loss or nn.CrossEntropyLoss(),
        torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1),
        inputs=(0,),
        print_summary=False,
    )
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,  # type: ignore[arg-type]
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.global_step == 2
    return module


TRAINED_OPS: dict[str, Callable[..., Any]] = {
    "adaptive_max_pool1d": lambda h: F.adaptive_max_pool1d(h[:, None], 24).flatten(1),
    "adaptive_max_pool1d_indices": lambda h: (
        F.adaptive_max_pool1d(h[:, None], 6, return_indices=True)[0].repeat(1, 1, 4).flatten(1)
    ),
    "adaptive_max_pool2d": lambda h: F.adaptive_max_pool2d(h.view(-1, 1, 4, 6), (4, 6)).flatten(1),
    "cummax": lambda h: torch.cummax(h, 1).values,
    "cummin_btc": lambda h: torch.cummin(h.view(-1, 4, 6), -2).values.flatten(1),
    "rrelu": nn.RReLU(),
    "rrelu_functional": lambda h: F.rrelu(h, 0.1, 0.2, training=True),
    "normal_noise": lambda h: h + torch.empty_like(h).normal_(0, 0.1),
    "uniform_noise": lambda h: h + torch.empty_like(h).uniform_(-0.1, 0.1),
}


@pytest.mark.parametrize("name", sorted(TRAINED_OPS))
def test_each_op_trains_through_from_torch_with_a_real_trainer(name: str) -> None:
    torch.manual_seed(0)
    net = _Net(TRAINED_OPS[name])
    before = net.inp.weight.detach().clone()
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    module = _fit(net, x, y)
    after = module.torch_state_dict()["inp.weight"]
    assert torch.isfinite(after).all() and not torch.equal(after, before)


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 12), nn.ReLU())
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.view(-1, 1, 3, 4)).mean((2, 3))


class _MatMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


@pytest.mark.parametrize(
    ("net", "dtype", "said", "where"),
    [
        (_Lin, torch.bfloat16, "mat1 and mat2 must have the same dtype", "module body.0 (Linear)"),
        (_Lin, torch.float16, "but got Half and Float", "module body.0 (Linear)"),
        (_Conv, torch.bfloat16, "Input type (BFloat16)", "module conv (Conv2d)"),
        (_MatMul, torch.bfloat16, "mat1 and mat2 must have the same dtype", "<root> (_MatMul)"),
    ],
)
def test_an_input_of_another_dtype_than_the_weights_is_refused_as_torch_does(
    net: type[nn.Module], dtype: torch.dtype, said: str, where: str
) -> None:
    """Before: JAX promoted the bfloat16/float16 input to float32 and trained (a Conv2d
    raised torch's bare RuntimeError, reported as an op torchax cannot trace)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12).to(dtype), torch.randint(0, 5, (16,))
    with pytest.raises(Exception, match=r"m1 and m2|mat1|Input type") as torch_info:
        net()(x)  # plain torch refuses
    assert isinstance(torch_info.value, RuntimeError)
    with pytest.raises(TorchModelError) as info:
        _fit(net(), x, y)
    message = str(info.value)
    name = str(dtype).removeprefix("torch.")
    assert said in message and where in message, message
    assert f"{name}, weight float32" in message or f"self {name}" in message, message
    assert "does not promote" in message and "Fix: cast the batch field" in message
    assert "x.to(torch.float32)" in message and f"module.to(torch.{name})" in message


def test_inputs_in_the_weights_dtype_still_train() -> None:
    """The accepted cases: float32 into float32 layers, and a module cast to bfloat16 with
    bfloat16 inputs (all operands alike)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    _fit(_Conv(), x, y)
    _fit(_MatMul(), x, y)
    net = _Lin().to(torch.bfloat16)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), target)

    module = _fit(net, x.bfloat16(), y, loss)
    assert module.torch_state_dict()["head.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), F.cross_entropy, nn.NLLLoss()])
@pytest.mark.parametrize(("dtype", "found"), [(torch.int16, "Short"), (torch.int8, "Char")])
def test_class_targets_torch_refuses_are_refused(loss: Any, dtype: torch.dtype, found: str) -> None:
    """torch 2.9 refuses int16/int8 class indices ('expected scalar type Long but found
    Short'); before, the traced step took them and trained."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,)).to(dtype)
    with pytest.raises(RuntimeError, match=f"expected scalar type Long but found {found}"):
        loss(_Lin()(x).log_softmax(-1), y)  # plain torch
    with pytest.raises(TorchModelError) as info:
        _fit(_Lin(), x, y, loss)
    message = str(info.value)
    name = str(dtype).removeprefix("torch.")
    assert f"class-index target is {name}" in message, message
    assert f"expected scalar type Long but found {found}" in message
    assert "Fix: .long() on the labels" in message


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_class_targets_torch_takes_still_train(dtype: torch.dtype) -> None:
    """int64 and uint8 as torch (int32, which torch refuses, is refused by the batch field's
    host dtype: test_trace_leftovers.py)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,)).to(dtype)
    _fit(_Lin(), x, y)


class _Frozen(nn.Module):
    """A trained Linear, a float32 buffer it multiplies by, a frozen Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.f = nn.Linear(12, 12), nn.Linear(12, 5).requires_grad_(False)
        self.register_buffer("proj", torch.randn(12, 12), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.a(x) @ self.proj)


def test_bf16_mixed_compute_takes_float32_buffers_and_frozen_weights() -> None:
    """``Trainer(precision="bf16-mixed")`` casts the trained params and the batch to
    bfloat16, not buffers or frozen weights: as under ``torch.autocast``, those matmuls are
    taken (the refusal above is for steps computing in the module's own dtype)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    module = _fit(_Frozen(), x, y, precision="bf16-mixed")
    assert module.torch_state_dict()["a.weight"].dtype == torch.float32
    with pytest.raises(TorchModelError, match=r"module a \(Linear\)"):
        _fit(_Frozen(), x.bfloat16(), y)  # float32 compute, a bfloat16 batch: refused
