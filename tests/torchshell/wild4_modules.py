"""LightningModules, data modules and torch models written the way tutorials, Kaggle notebooks
and public projects write them, for test_port_wild4.py (round 4: none repeats round 3's).

Nothing here knows about coreshell.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from tests.torchshell.wild3_modules import Sentences

__all__ = ["Sentences"]  # (round 3's token rows, used with PackedLSTM)

# -- data ---------------------------------------------------------------------------------------


def table(n: int, seed: int, features: int = 8, dtype: torch.dtype = torch.float32) -> Any:
    """``(x[features], y in 0..2)`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x.to(dtype), y)


class Images(Dataset):
    """Kaggle-style rows: ``{"id": "img_0007", "image": uint8[1, 8, 8], "label": int}``."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
        self.labels = (self.images.float().mean((1, 2, 3)) > 127.5).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": f"img_{i:04d}", "image": self.images[i], "label": int(self.labels[i])}


class TableData(L.LightningDataModule):
    """The docs' DataModule: ``prepare_data`` writes the data once, ``setup(stage)`` splits
    it with ``random_split`` and a seeded generator, one loader per stage."""

    def __init__(self, root: str, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.path = f"{root}/table.pt"

    def prepare_data(self) -> None:
        ds = table(96, 0)
        torch.save({"x": ds.tensors[0], "y": ds.tensors[1]}, self.path)

    def setup(self, stage: str) -> None:
        raw = torch.load(self.path)
        full = TensorDataset(raw["x"], raw["y"])
        if stage in ("fit", "validate"):
            self.train_set, self.val_set, _ = random_split(
                full, [64, 16, 16], generator=torch.Generator().manual_seed(42)
            )
        if stage in ("test", "predict"):
            _, _, self.test_set = random_split(
                full, [64, 16, 16], generator=torch.Generator().manual_seed(42)
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


# -- 1. hparams lr, the datamodule's loaders, test_step, predict_step returning argmax ---------


class LitClassifier(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.l1 = nn.Linear(8, self.hparams.hidden)
        self.l2 = nn.Linear(self.hparams.hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def _shared(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(dim=1) == y).float().mean()
        return F.cross_entropy(logits, y), acc

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, acc = self._shared(batch)
        self.log_dict({"train_loss": loss, "train_acc": acc}, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, acc = self._shared(batch)
        self.log_dict({"val_loss": loss, "val_acc": acc}, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, acc = self._shared(batch)
        self.log_dict({"test_loss": loss, "test_acc": acc})

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x, _ = batch
        return self(x).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


# -- 2. mixup with a numpy Beta draw and a randperm in training_step ---------------------------


class MixupNumpy(L.LightningModule):
    def __init__(self, alpha: float = 0.4) -> None:
        super().__init__()
        self.alpha = alpha
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        lam = float(np.random.beta(self.alpha, self.alpha))
        index = torch.randperm(x.size(0))
        mixed = lam * x + (1 - lam) * x[index]
        logits = self.net(mixed)
        loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
        self.log("lam", lam)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MixupTorchBeta(MixupNumpy):
    """The same mixup, lambda drawn from ``torch.distributions.Beta``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        lam = torch.distributions.Beta(self.alpha, self.alpha).sample()
        index = torch.randperm(x.size(0))
        mixed = lam * x + (1 - lam) * x[index]
        logits = self.net(mixed)
        loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
        self.log("lam", lam)
        self.log("train_loss", loss)
        return loss


# -- 3. gradient checkpointing in the forward -------------------------------------------------


class Checkpointed(L.LightningModule):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(2)
        )
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 4. an EMA of the weights kept in on_train_batch_end --------------------------------------


class EmaInHook(L.LightningModule):
    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ema = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ema.load_state_dict(self.net.state_dict())
        self.ema.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    @torch.no_grad()
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for e, p in zip(self.ema.parameters(), self.net.parameters(), strict=True):
            e.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss_ema", F.cross_entropy(self.ema(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.2, momentum=0.9)


# -- 5. multi-label head: BCEWithLogitsLoss(pos_weight), log_dict(prog_bar), OneCycleLR ------


class MultiLabel(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 4))
        self.criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 3.0, 0.5]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        targets = torch.stack([x[:, 0] > 0, x[:, 1] > 0, x[:, 2] > 1, y == 2], dim=1).float()
        logits = self.net(x)
        loss = self.criterion(logits, targets)
        preds = (torch.sigmoid(logits) > 0.5).float()
        self.log_dict(
            {"train_loss": loss, "train_hamming": (preds != targets).float().mean()},
            prog_bar=True,
            on_step=True,
            on_epoch=True,
        )
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return [opt], [{"scheduler": sched, "interval": "step"}]


# -- 6. uint8 images in a dict with a string id, normalised in the model; class weights ------


class ImageNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.5]).view(1, 1, 1, 1))
        self.register_buffer("std", torch.tensor([0.25]).view(1, 1, 1, 1))
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Linear(4 * 4 * 4, 2)
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image.float() / 255.0 - self.mean) / self.std
        return self.head(torch.flatten(self.features(x), 1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.criterion(self(batch["image"]), batch["label"])
        self.log("train_loss", loss, batch_size=len(batch["id"]))
        return loss

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return {"id": batch["id"], "pred": self(batch["image"]).argmax(1)}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2),
        }


# -- 7. a float16 feature table, cast in the model; a smooth-L1 regression head [B, 1] ------


class HalfInputRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        target = (x.float().sum(1, keepdim=True) + y.unsqueeze(1).float()) / 4
        loss = F.smooth_l1_loss(self(x), target, beta=0.5)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=1e-2, alpha=0.9)


# -- 8. clip_grad_norm_ in on_before_optimizer_step, warm restarts per step ------------------


class ClipsInHook(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y) * 5.0
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.5)
        self.log("grad_norm", norm)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- 9. an LSTM over packed sequences in a LightningModule with a dict batch ----------------


class PackedLSTM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(32, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.lstm(packed)
        return self.fc(torch.cat([h[-2], h[-1]], dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, lengths, labels = batch
        loss = F.cross_entropy(self(tokens, lengths), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 10. tensors made on self.device / type_as in the step, a torch.compile'd backbone ------


class DeviceTensors(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        noise_scale = torch.tensor(0.0, device=self.device)
        x = x + noise_scale * torch.ones(x.shape, device=self.device).type_as(x)
        onehot = torch.zeros(x.size(0), 3, device=self.device).scatter_(1, y.unsqueeze(1), 1.0)
        loss = -(onehot * F.log_softmax(self.net(x), dim=1)).sum(1).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)
