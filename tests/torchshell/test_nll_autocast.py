"""Class-index losses under torch's autocast policy in a traced step (issue 51's note): torch
runs ``cross_entropy``/``nll_loss`` in float32 under autocast (CPU and CUDA), and CUDA's list
adds ``log_softmax``/``softmax``; the traced graph computed ``log_softmax`` in bfloat16 before
them, inside a user's ``torch.autocast`` region and under ``precision="bf16-mixed"``."""

from __future__ import annotations

from pathlib import Path
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

from tests.helpers import fit_plain_and_ported
from torchshell.torch_model import torch_model_fns

ROWS, FEATURES, CLASSES = 16, 32, 50


class _Head(nn.Module):
    """``Linear(32, 50)`` -> a class-index loss, in a user's ``torch.autocast`` region or
    not (``region=False``: under ``bf16-mixed`` the step casts the weights)."""

    def __init__(self, fn: str, region: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.fn, self.region = nn.Linear(FEATURES, CLASSES), fn, region

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fn == "nll_loss":
            return F.nll_loss(F.log_softmax(logits, 1), y)
        if self.fn == "nll_loss_2d":
            return F.nll_loss(F.log_softmax(logits[..., None], 1), y[:, None])
        return F.cross_entropy(logits, y, label_smoothing=0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.region:
            return self.loss(self.net(x), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.loss(self.net(x), y)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g) * 3
    y = torch.randint(0, CLASSES, (ROWS,), generator=g)
    y[::5] = -100
    return x, y


def _traced(module: nn.Module, bf16_weights: bool) -> tuple[jax.Array, dict[str, Any]]:
    """The traced loss and its gradient for the float32 weights (cast to bfloat16 inside
    the differentiated function where ``bf16_weights``: what ``bf16-mixed`` does)."""
    x, y = _data()
    fns = torch_model_fns(module, inputs=("x", "y"))
    batch = {"x": jnp.asarray(x.numpy()), "y": jnp.asarray(y.numpy())}
    params, state = fns.init(jax.random.key(0), batch)

    def loss(p: dict) -> tuple[jax.Array, Any]:
        if bf16_weights:
            p = jax.tree.map(lambda v: v.astype(jnp.bfloat16), p)
            batch16 = {"x": batch["x"].astype(jnp.bfloat16), "y": batch["y"]}
            out = fns.apply(p, state, batch16, jax.random.key(1), True)[0]
        else:
            out = fns.apply(p, state, batch, jax.random.key(1), True)[0]
        return out.astype(jnp.float32), out.dtype

    (value, dtype), grads = jax.value_and_grad(lambda p: loss(p), has_aux=True)(params)
    return value, {"dtype": dtype, "grads": grads}


def _torch(module: _Head, upcast_log_softmax: bool = False) -> tuple[torch.Tensor, Any]:
    """torch's own CPU autocast (``upcast_log_softmax``: CUDA's list, log_softmax in
    float32, emulated by casting its input)."""
    x, y = _data()
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = module.net(x)
        if upcast_log_softmax:
            logits = logits.float()
        out = module.loss(logits, y)
    out.backward()
    return out, module.net.weight.grad


def _close_grads(got: Any, want: torch.Tensor) -> float:
    """The gradients' relative distance (bfloat16 matmuls on both sides: a norm, not each
    element)."""
    got = np.asarray(got)
    return float(np.linalg.norm(got - want.numpy()) / np.linalg.norm(want.numpy()))


@pytest.mark.parametrize(
    ("fn", "rtol"), [("cross_entropy", 1e-4), ("nll_loss", 2e-3), ("nll_loss_2d", 2e-3)]
)
def test_a_user_autocast_region_computes_class_index_losses_as_torch(fn: str, rtol: float) -> None:
    """torch CPU autocast: cross_entropy and nll_loss in float32, a float32 loss (an explicit
    log_softmax stays bfloat16 on CPU: its bfloat16 log-probabilities are the nll cases'
    tolerance). Before, the traced loss was bfloat16 and cross_entropy's log_softmax too:
    2.5e-3 from torch (gradients 1.5e-2); now 2.4e-5 (4.8e-3)."""
    module = _Head(fn, region=True)
    want, grad = _torch(module)
    got, aux = _traced(module, bf16_weights=False)
    assert want.dtype == torch.float32 and aux["dtype"] == jnp.float32
    np.testing.assert_allclose(float(got), float(want.detach()), rtol=rtol)
    assert _close_grads(aux["grads"]["net.weight"], grad) < 1e-2


@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_bf16_mixed_computes_class_index_losses_as_torch_autocast(fn: str) -> None:
    """``bf16-mixed`` (weights and batch cast to bfloat16): cross_entropy as torch's autocast
    (float32 on CPU and CUDA); an explicit log_softmax before nll_loss as CUDA's autocast
    (float32), the device a team runs bf16-mixed on. Before: 2.5e-3 / 1.8e-3 from torch,
    a bfloat16 loss; now 2.4e-5 / 2.7e-5."""
    module = _Head(fn, region=False)
    want, grad = _torch(module, upcast_log_softmax=fn == "nll_loss")
    got, aux = _traced(module, bf16_weights=True)
    assert aux["dtype"] == jnp.float32
    np.testing.assert_allclose(float(got), float(want.detach()), rtol=1e-4)
    assert _close_grads(aux["grads"]["net.weight"], grad) < 1e-2


class _Softmax(nn.Module):
    """``softmax(x * scale)`` (``scale`` a weight of 1: the scores are the batch's, exactly)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * self.scale, -1)


def test_bf16_mixed_softmax_computes_in_float32_and_keeps_the_input_dtype() -> None:
    """CUDA autocast's float32 softmax feeds the bfloat16 matmul after it; the traced one
    computes in float32 and gives bfloat16 back (attention stays a bfloat16 matmul): equal to
    torch's float32 softmax rounded to bfloat16 (before: 373 of 512 values differed)."""
    x, y = _data()
    x = (x * 2).bfloat16()
    fns = torch_model_fns(_Softmax(), inputs=("x", "y"))
    batch = {"x": jnp.asarray(x.float().numpy()).astype(jnp.bfloat16), "y": jnp.asarray(y)}
    params, state = fns.init(jax.random.key(0), batch)
    cast = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    out = fns.apply(cast, state, batch, jax.random.key(1), True)[0]
    assert out.dtype == jnp.bfloat16
    want = torch.softmax(x.float(), -1).bfloat16().float().numpy()
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


class _Classifier(L.LightningModule):
    """``Linear(32, 50)`` -> ``F.cross_entropy``, its loss logged."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_bf16_mixed_fit_logs_plain_lightnings_bf16_mixed_loss(tmp_path: Path) -> None:
    """The real Trainer, ``precision="bf16-mixed"``, one step: plain Lightning (torch's CPU
    autocast) and ``from_lightning`` log the same first loss: 1.2e-4 apart (the bfloat16
    logits of two matmul kernels). Before: 1.8e-3 (the traced log_softmax in bfloat16, a
    bfloat16 loss)."""
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=ROWS)
    runs = fit_plain_and_ported(_Classifier, tmp_path, loader, precision="bf16-mixed", max_steps=1)
    want = float(runs["plain"][0].callback_metrics["train_loss"])
    got = float(runs["jax"][0].callback_metrics["train_loss"])
    np.testing.assert_allclose(got, want, rtol=5e-4)
