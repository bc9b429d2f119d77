"""The one-line port: a team's LightningModule, unchanged, trained by a jitted JAX step.

Everything below ``Digits`` is what a PyTorch team already has: a ``TensorDataset`` of
tuples, a torch loss with label smoothing, ``self.log``, AdamW with two parameter groups and
a per-step ``OneCycleLR``. The port is the one line marked ``<-``; the checkpoint it writes
still loads with ``Digits.load_from_checkpoint`` in plain Lightning.

Run: ``python examples/port_one_line.py --epochs 3``
"""

from __future__ import annotations

import argparse
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from torchshell import JaxModule


class Digits(L.LightningModule):
    """An 8x8 digit classifier, written for plain Lightning."""

    def __init__(self, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=0.1)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    train, val = random_split(data, [1500, 297], generator=torch.Generator().manual_seed(0))
    return DataLoader(train, batch_size, shuffle=True), DataLoader(val, batch_size)


def main(epochs: int = 3, ckpt_dir: str | None = None) -> float:
    """Trains the unchanged module through coreshell; returns the validation accuracy."""
    torch.manual_seed(0)
    train, val = loaders()
    ckpt = ModelCheckpoint(dirpath=ckpt_dir or tempfile.mkdtemp(), monitor="val_acc", mode="max")
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[ckpt], logger=False, enable_model_summary=False
    )
    trainer.fit(JaxModule.from_lightning(Digits()), train, val)  # <- the port
    restored = Digits.load_from_checkpoint(ckpt.best_model_path)  # plain Lightning again
    print(f"best checkpoint {ckpt.best_model_path} loads in plain Lightning: {restored.hparams}")
    return float(trainer.callback_metrics["val_acc"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    print(f"validation accuracy: {main(parser.parse_args().epochs):.3f}")
