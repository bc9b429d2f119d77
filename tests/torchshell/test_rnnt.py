"""``torchaudio.functional.rnnt_loss`` in a traced step (torchshell/trace/_rnnt.py, issue 39).

Before: a transducer trained with torchaudio's RNN-T loss through ``from_lightning`` /
``from_torch`` failed with torchax's raw ``AssertionError: torchax Tensors can only do math
within the torchax environment`` (no lowering for ``torchaudio::rnnt_loss_forward``).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch
import torchaudio
import torchaudio.functional as AF
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell.test_port import Recorder
from torchshell.trace._rnnt import rnnt_costs

pytestmark = pytest.mark.filterwarnings("ignore:.*torchaudio.*:UserWarning")


def _j(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.detach().numpy())


def _case(g: torch.Generator, b: int, t: int, u: int, d: int, blank: int) -> tuple[Any, ...]:
    """Random labels (never ``blank``) and ragged lengths; the longest fill the padded dims."""
    xl = torch.randint(1, t + 1, (b,), generator=g, dtype=torch.int32)
    yl = torch.randint(0, u + 1, (b,), generator=g, dtype=torch.int32)
    xl[0], yl[-1] = t, u
    y = torch.randint(0, d - 1, (b, u), generator=g, dtype=torch.int32)
    return torch.where(y >= blank, y + 1, y), xl, yl


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _costs_and_vjp(
    x: jax.Array,
    y: jax.Array,
    xl: jax.Array,
    yl: jax.Array,
    cotangent: jax.Array,
    blank: int,
    clamp: float,
    fused: bool,
) -> tuple[jax.Array, jax.Array]:
    costs, pullback = jax.vjp(lambda a: rnnt_costs(a, y, xl, yl, blank, clamp, fused), x)
    return costs, pullback(cotangent)[0]


@pytest.mark.parametrize(
    ("fused", "clamp"), [(True, -1.0), (True, 0.02), (False, -1.0), (False, 0.05)]
)
def test_rnnt_costs_match_torchaudio(fused: bool, clamp: float) -> None:
    """Values and gradients equal torchaudio's for each reduction, a blank in any position,
    ragged logit and target lengths (an empty target included), with and without the fused
    log-softmax, with and without torchaudio's gradient clamp (applied before the incoming
    gradient scales it, as torchaudio's backward does)."""
    case_id = 2 * int(fused) + int(clamp > 0)
    g = torch.Generator().manual_seed(case_id)
    shapes = [(3, 7, 4, 6), (2, 5, 0, 3), (4, 3, 6, 5), (3, 9, 3, 4)]
    for b, t, u, d in shapes[case_id : case_id + 1]:
        blank = int(torch.randint(0, d, (1,), generator=g))
        y, xl, yl = _case(g, b, t, u, d, blank)
        for reduction in ("none", "mean", "sum"):
            x = torch.randn(b, t, u + 1, d, generator=g) * 2
            x = (x if fused else x.log_softmax(-1)).requires_grad_()
            ref = AF.rnnt_loss(x, y, xl, yl, blank, clamp, reduction, fused)
            w = torch.rand(ref.shape, generator=g) + 0.5  # a cotangent that is not all ones
            (ref * w).sum().backward()
            assert x.grad is not None
            # the reduction's gradient on the costs: torch's mean/sum backward
            cotangent = {"none": w, "mean": w.expand(b) / b, "sum": w.expand(b)}[reduction]
            costs, grad = _costs_and_vjp(
                _j(x), _j(y), _j(xl), _j(yl), _j(cotangent), blank, clamp, fused
            )
            got = {"none": costs, "mean": costs.mean(), "sum": costs.sum()}[reduction]
            case = f"B={b} T={t} U={u} D={d} blank={blank} {reduction}"
            np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-5, err_msg=case)
            np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=case)


class _Transducer(L.LightningModule):
    """A small RNN-T: a frame encoder, an LSTM predictor over the blank-prefixed labels, an
    additive joiner, and torchaudio's loss (blank last, as torchaudio's Emformer recipe): its
    functional form at its defaults plus its ``RNNTLoss`` module with a gradient clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.blank, symbols = 5, 6
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.embed = nn.Embedding(symbols, 8)
        self.predictor = nn.LSTM(8, 16, batch_first=True)
        self.joiner = nn.Linear(16, symbols)
        self.clamped = torchaudio.transforms.RNNTLoss(blank=self.blank, clamp=0.05, reduction="sum")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, frames, y, label_lengths = batch
        prefixed = torch.cat([torch.full_like(y[:, :1], self.blank), y], dim=1)
        pred, _ = self.predictor(self.embed(prefixed))  # [B, U + 1, H]
        joint = torch.tanh(self.encoder(x)[:, :, None] + pred[:, None])  # [B, T, U + 1, H]
        logits = self.joiner(joint)
        lengths = (y.int(), frames.int(), label_lengths.int())
        loss = AF.rnnt_loss(logits, *lengths, blank=self.blank)  # fused log-softmax, mean
        loss = loss + self.clamped(logits, *lengths) / x.shape[0]  # one compiled step for both
        self.log("rnnt", loss, on_step=True, on_epoch=True, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def test_a_transducer_trains_as_plain_lightning(tmp_path: Path) -> None:
    """Before: torchax's raw ``AssertionError`` (no lowering for
    ``torchaudio::rnnt_loss_forward``). Now the RNN-T recursion runs in the step: under a
    real ``lightning.Trainer`` every step's loss and the trained weights equal plain
    Lightning's, with ragged frames and labels, torchaudio's functional loss and its
    ``RNNTLoss`` module with a gradient clamp that bites (0.05 against per-element gradients
    up to 1)."""
    from torchshell import JaxModule

    g = torch.Generator().manual_seed(0)
    n, t, u = 24, 10, 4
    frames = torch.randint(3, t + 1, (n,), generator=g)
    labels = torch.randint(0, 5, (n, u), generator=g)
    label_lengths = torch.randint(0, u + 1, (n,), generator=g)
    frames[::6], label_lengths[::6] = t, u  # each batch's longest fill the padded dims
    data = TensorDataset(torch.randn(n, t, 8, generator=g), frames, labels, label_lengths)
    losses, weights = {}, {}
    for mode in ("plain", "jax"):
        torch.manual_seed(0)
        user = _Transducer()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        rows = Recorder()
        trainer = L.Trainer(
            logger=rows,
            log_every_n_steps=1,
            max_epochs=2,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torchaudio.*")
            trainer.fit(module, DataLoader(data, batch_size=6))
        losses[mode] = rows.series("rnnt_step")
        weights[mode] = user.state_dict() if mode == "plain" else module.torch_state_dict()
    assert len(losses["plain"]) == 8
    np.testing.assert_allclose(losses["jax"], losses["plain"], rtol=1e-4, atol=1e-5)
    assert losses["plain"][-1] < losses["plain"][0]  # it learns
    for name, w in weights["plain"].items():
        torch.testing.assert_close(weights["jax"][name], w, rtol=1e-4, atol=1e-5, msg=name)
