"""A LightningModule written for the digits recipe's dict batches, trained by the CLI."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class LitDigits(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.example_input_array = torch.zeros(2, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["x"]), batch["y"].long())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["x"])
        self.log("val_acc", (logits.argmax(-1) == batch["y"]).float().mean(), prog_bar=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return self(batch["x"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class StepsOnly(L.LightningModule):
    """Computes in its steps only (no forward), with a metric object and a plateau schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(batch["x"]), batch["y"].long())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_acc(self.net(batch["x"]), batch["y"].long())
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_acc"}}
