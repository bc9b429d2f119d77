"""``F.cross_entropy`` / ``F.nll_loss`` on class indices in a traced step: torch's values and
gradients, through a one-hot select (no gather, no scatter in the gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchshell.torch_model import torch_model_fns


class Loss(nn.Module):
    """A parameter of logits and a loss of it against the batch's targets."""

    def __init__(self, shape: tuple[int, ...], fn: str, **kwargs: object) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.logits = nn.Parameter(torch.randn(*shape, generator=g))
        weight = kwargs.pop("weight", None)
        self.register_buffer("weight", weight if weight is None else torch.as_tensor(weight))
        self.fn, self.kwargs = fn, kwargs

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        kwargs = dict(self.kwargs, weight=self.weight)
        if self.fn == "nll_loss":
            return F.nll_loss(
                self.logits.log_softmax(1 if self.logits.ndim > 1 else 0), y, **self.kwargs
            )
        return F.cross_entropy(self.logits, y, **kwargs)


def _targets(shape: tuple[int, ...], classes: int, ignored: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, classes, shape, generator=g)
    if ignored == "some":
        y.view(-1)[::3] = -100
    if ignored == "all":
        y[...] = -100
    return y


CASES = [
    # (logits shape, fn, kwargs, ignored)
    ((6, 5), "cross_entropy", {}, "none"),
    ((6, 5), "cross_entropy", {"reduction": "sum"}, "some"),
    ((6, 5), "cross_entropy", {"reduction": "none"}, "some"),
    ((6, 5), "cross_entropy", {}, "some"),
    ((6, 5), "cross_entropy", {}, "all"),  # torch: NaN
    ((6, 5), "cross_entropy", {"weight": torch.linspace(0.5, 2.0, 5)}, "some"),
    ((6, 5), "cross_entropy", {"label_smoothing": 0.1}, "some"),
    ((6, 5), "cross_entropy", {"ignore_index": 2}, "none"),
    ((2, 5, 3, 4), "cross_entropy", {}, "some"),  # nll_loss2d
    ((2, 5, 7), "cross_entropy", {"reduction": "none"}, "some"),
    ((5,), "cross_entropy", {}, "none"),  # unbatched
    ((6, 5), "nll_loss", {"weight": torch.linspace(2.0, 0.5, 5), "reduction": "sum"}, "some"),
]


@pytest.mark.parametrize(("shape", "fn", "kwargs", "ignored"), CASES)
def test_class_index_losses_equal_torch_values_and_gradients(
    shape: tuple[int, ...], fn: str, kwargs: dict, ignored: str
) -> None:
    classes = shape[0] if len(shape) == 1 else shape[1]
    target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
    y = _targets(target_shape, classes, ignored)
    if len(shape) == 1 and ignored == "none":
        y = torch.tensor(3)
    module = Loss(shape, fn, **kwargs)
    fns = torch_model_fns(module, inputs=("y",))
    batch = {"y": jnp.asarray(y.numpy())}
    params, state = fns.init(jax.random.key(0), batch)

    def loss(p: dict) -> jax.Array:
        out = fns.apply(p, state, batch, jax.random.key(1), True)[0]
        return jnp.sum(out * jnp.cos(jnp.arange(out.size)).reshape(out.shape))

    ref = module(y)
    w = torch.cos(torch.arange(ref.numel(), dtype=torch.float32)).reshape(ref.shape)
    (ref * w).sum().backward()
    value, grads = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(float(value), float((ref * w).sum().detach()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grads["logits"]), module.logits.grad.numpy(), rtol=1e-5, atol=1e-6
    )
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(loss))(params))  # a select, fused


def test_bfloat16_cross_entropy_keeps_its_dtype_and_is_close_to_float32() -> None:
    y = _targets((8,), 50, "some")
    module = Loss((8, 50), "cross_entropy").to(torch.bfloat16)
    fns = torch_model_fns(module, inputs=("y",))
    batch = {"y": jnp.asarray(y.numpy())}
    params, state = fns.init(jax.random.key(0), batch)
    out = fns.apply(params, state, batch, jax.random.key(1), True)[0]
    assert out.dtype == jnp.bfloat16
    want = F.cross_entropy(module.logits.float(), y)
    np.testing.assert_allclose(float(out), float(want.detach()), rtol=1e-2)
