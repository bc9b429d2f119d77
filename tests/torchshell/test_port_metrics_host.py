"""torchmetrics objects whose ``update`` a compiled step cannot run (a shape that depends on
values: ``ignore_index``'s boolean mask; a list state: AUROC) updated on the host from the
traced step's outputs, as plain Lightning runs them eagerly: logged values equal plain
Lightning's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell.port_helpers import agree
from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell._errors import ConfigError

C = 3


def _loader(n: int, seed: int) -> DataLoader:
    """``(x[8], y in 0..2 or -100)`` rows in batches of 8 (the last one ragged)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    y[torch.rand(n, generator=g) < 0.25] = -100  # ignored rows (padding tokens)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class HostMetrics(L.LightningModule):
    """F1 and accuracy with ``ignore_index``, AUROC (a list state), as projects log them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, C))
        kw: dict[str, Any] = {"task": "multiclass", "num_classes": C, "ignore_index": -100}
        self.train_acc = torchmetrics.Accuracy(**kw)
        self.val_f1 = torchmetrics.F1Score(**kw)
        self.val_acc = torchmetrics.Accuracy(**kw)
        self.val_auroc = torchmetrics.AUROC(**kw)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y, ignore_index=-100)
        self.train_acc(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_f1.update(logits, y)
        self.log("val/f1", self.val_f1)
        self.log("val/acc_batch", self.val_acc(logits.argmax(-1), y))  # its batch value
        self.val_auroc.update(logits.softmax(-1), y)
        self.log("val/auroc", self.val_auroc)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _fit(jax: bool, root: Path) -> tuple[L.Trainer, HostMetrics]:
    torch.manual_seed(0)
    user = HostMetrics()
    module = JaxModule.from_lightning(user, print_summary=False) if jax else user
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=Recorder(),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=root,
    )
    trainer.fit(module, _loader(32, 0), _loader(20, 1))
    return trainer, user


def test_metrics_with_value_dependent_shapes_match_plain_lightning(tmp_path: Path) -> None:
    runs = {"plain": _fit(False, tmp_path / "p"), "jax": _fit(True, tmp_path / "j")}
    series = ("train_loss", "train_acc_step", "train_acc_epoch", "val/f1", "val/auroc")
    agree(runs, (*series, "val/acc_batch"), 1e-4)


class BatchValueUsed(L.LightningModule):
    def __init__(self, log: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(8, C)
        self.f1 = torchmetrics.F1Score(task="multiclass", num_classes=C, ignore_index=-100)
        self.logs = log

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y, ignore_index=-100)
        if self.logs:  # (a batch value that exists only after the step: log the object)
            self.log("f1", self.f1(logits, y))
            return loss
        return loss * (1 - self.f1(logits, y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("log", "what"), [(False, "computes with"), (True, "logs")])
def test_a_host_metric_batch_value_used_in_the_step_is_refused(
    tmp_path: Path, log: bool, what: str
) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    module = JaxModule.from_lightning(BatchValueUsed(log), print_summary=False)
    with pytest.raises(ConfigError, match=rf"{what} .* self\.f1, .*on the host.*Fix: log"):
        trainer.fit(module, _loader(16, 0))
