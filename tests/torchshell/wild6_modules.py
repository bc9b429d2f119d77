"""LightningModules and ``nn.Module``s written the way public projects write them (round 6):
SimCLR's NT-Xent on masks built from shapes (the UvA tutorial), a multitask model with a
``ModuleDict`` of heads and learned task weights in a ``ParameterList``, HiFi-GAN's
``weight_norm`` convolutions, a char-RNN (its hidden state made afresh per batch),
torchmetrics' ``MetricCollection.clone(prefix=...)`` computed in an epoch-end hook,
``on_save_checkpoint``/``on_load_checkpoint`` extra keys, the UvA tutorials'
``GenerateCallback`` (``pl_module.eval()``, ``pl_module(x)``, ``pl_module.hparams``), a
``predict_step`` returning a dict with a ``BasePredictionWriter``, a DataModule whose
``setup(stage)`` the module reads and whose ``on_after_batch_transfer`` scales the batch,
Lightning docs' warm-up in ``optimizer_step``, ``ReduceLROnPlateau`` validated every other
epoch, a mixture of experts in a ``ParameterList``, for test_port_wild6.py. Nothing here
knows about coreshell."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

# -- data ---------------------------------------------------------------------------------------


def table(n: int, seed: int, features: int = 8) -> TensorDataset:
    """``(x[features], y in 0..2)`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


def views(n: int, seed: int) -> TensorDataset:
    """SimCLR rows ``(view_a[8], view_b[8])``: two fixed augmentations of one row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x + 0.1 * torch.randn(n, 8, generator=g), x * 0.9)


def multitask(n: int, seed: int) -> TensorDataset:
    """``(x[8], class in 0..2, target float)`` rows."""
    x, y = table(n, seed).tensors
    return TensorDataset(x, y, x[:, 2] * 2.0 - x[:, 3])


def text(n: int, seed: int, length: int = 6, vocab: int = 10) -> TensorDataset:
    """Char-RNN rows ``(chars[length], next chars[length])``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, length + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


class Pixels(Dataset):
    """``{"image": uint8[16], "label": int}`` rows (scaled to float on the host by the
    DataModule's ``on_after_batch_transfer``)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 16), generator=g, dtype=torch.uint8)
        self.labels = (self.images[:, :8].float().mean(1) > 127.5).long() + (
            self.images[:, 8].long() > 200
        ).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i], "label": int(self.labels[i])}


# -- 1. SimCLR (UvA DL tutorial 17): NT-Xent on masks from shapes, top-k acc via argsort --------


class SimCLR(L.LightningModule):
    def __init__(self, hidden_dim: int = 8, lr: float = 5e-3, temperature: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.convnet = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, hidden_dim))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
        lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=4, eta_min=self.hparams.lr / 50
        )
        return [optimizer], [lr_scheduler]

    def info_nce_loss(self, batch: Any, mode: str = "train") -> torch.Tensor:
        imgs = torch.cat(batch, dim=0)
        feats = self.head(self.convnet(imgs))
        cos_sim = F.cosine_similarity(feats[:, None, :], feats[None, :, :], dim=-1)
        self_mask = torch.eye(cos_sim.shape[0], dtype=torch.bool, device=cos_sim.device)
        cos_sim.masked_fill_(self_mask, -9e15)
        pos_mask = self_mask.roll(shifts=cos_sim.shape[0] // 2, dims=0)
        cos_sim = cos_sim / self.hparams.temperature
        nll = -cos_sim[pos_mask] + torch.logsumexp(cos_sim, dim=-1)
        nll = nll.mean()
        self.log(mode + "_loss", nll)
        comb_sim = torch.cat([cos_sim[pos_mask][:, None], cos_sim.masked_fill(pos_mask, -9e15)], 1)
        sim_argsort = comb_sim.argsort(dim=-1, descending=True).argmin(dim=-1)
        self.log(mode + "_acc_top1", (sim_argsort == 0).float().mean())
        self.log(mode + "_acc_top5", (sim_argsort < 5).float().mean())
        self.log(mode + "_acc_mean_pos", 1 + sim_argsort.float().mean())
        return nll

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.info_nce_loss(batch, mode="train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.info_nce_loss(batch, mode="val")


# -- 2. multitask: a ModuleDict of heads, uncertainty weights in a ParameterList -------------


class MultiTask(L.LightningModule):
    """Kendall et al.'s learned task weights: ``loss_i * exp(-s_i) + s_i``, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.GELU())
        self.heads = nn.ModuleDict({"cls": nn.Linear(16, 3), "reg": nn.Linear(16, 1)})
        self.log_vars = nn.ParameterList([nn.Parameter(torch.zeros(())) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {name: head(h) for name, head in self.heads.items()}

    def _losses(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y, target = batch
        out = self(x)
        return {
            "cls": F.cross_entropy(out["cls"], y),
            "reg": F.mse_loss(out["reg"].squeeze(-1), target),
        }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = self._losses(batch)
        total = sum(
            loss * torch.exp(-s) + s for loss, s in zip(losses.values(), self.log_vars, strict=True)
        )
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, on_step=True, on_epoch=True)
        self.log("train/total", total, prog_bar=True)
        self.log("train/w_cls", torch.exp(-self.log_vars[0]))
        return total

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        losses = self._losses(batch)
        self.log_dict({f"val/{k}": v for k, v in losses.items()})

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(
            [
                {"params": list(self.trunk.parameters()) + list(self.heads.parameters())},
                {"params": self.log_vars.parameters(), "lr": 0.05},
            ],
            lr=1e-2,
        )


# -- 3. HiFi-GAN's weight_norm convolutions (legacy hook and parametrization) -------------------


class ResBlock(nn.Module):
    def __init__(self, channels: int, legacy: bool) -> None:
        super().__init__()
        norm = nn.utils.weight_norm if legacy else nn.utils.parametrizations.weight_norm
        self.convs = nn.ModuleList(
            [norm(nn.Conv1d(channels, channels, 3, dilation=d, padding=d)) for d in (1, 3)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.convs:
            x = x + c(F.leaky_relu(x, 0.1))
        return x


class Vocoder(L.LightningModule):
    """Feature frames ``x[B, 8]`` read as ``[B, 1, 8]``; L1 to a target waveform."""

    def __init__(self, legacy: bool = False) -> None:
        super().__init__()
        norm = nn.utils.weight_norm if legacy else nn.utils.parametrizations.weight_norm
        self.pre = norm(nn.Conv1d(1, 4, 3, padding=1))
        self.block = ResBlock(4, legacy)
        self.post = norm(nn.Conv1d(4, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.post(self.block(self.pre(x[:, None]))))[:, 0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = F.l1_loss(self(x), torch.sin(x))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), 2e-3, betas=(0.8, 0.99))
        return [opt], [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999)]


# -- 4. a char-RNN: its hidden state made afresh (zeros on self.device) for every batch -------


class CharRNN(L.LightningModule):
    def __init__(self, vocab: int = 10, hidden: int = 8, layers: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=0.0)
        self.fc = nn.Linear(hidden, vocab)

    def init_hidden(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.hparams.layers, batch_size, self.hparams.hidden)
        return (torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        out, hidden = self.lstm(self.embed(x), hidden)
        return self.fc(out), hidden

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.init_hidden(x.size(0))
        logits, hidden = self(x, hidden)
        loss = F.cross_entropy(logits.reshape(-1, self.hparams.vocab), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 5. MetricCollection.clone(prefix=...): update in the step, compute in the epoch end ------


class CollectionClassifier(L.LightningModule):
    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, num_classes))
        metrics = torchmetrics.MetricCollection(
            [
                torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro"),
                torchmetrics.classification.MulticlassPrecision(num_classes, average="macro"),
                torchmetrics.classification.MulticlassRecall(num_classes, average="macro"),
            ]
        )
        self.train_metrics = metrics.clone(prefix="train_")
        self.val_metrics = metrics.clone(prefix="val_")
        self.test_metrics = metrics.clone(prefix="test_")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        output = self.train_metrics(logits, y)
        self.log_dict(output)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_metrics.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute())
        self.val_metrics.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_metrics.update(self(x), y)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


# -- 6. extra keys in the checkpoint: on_save_checkpoint / on_load_checkpoint ---------------


class WithVocab(L.LightningModule):
    """Stores its vocabulary and a step counter of its own beside the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.vocab = {"a": 0, "b": 1, "c": 2}
        self.loaded_vocab: dict[str, int] | None = None
        self.seen_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen_batches += 1

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vocab"] = dict(self.vocab)
        checkpoint["seen_batches"] = self.seen_batches

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_vocab = checkpoint["vocab"]
        self.seen_batches = checkpoint["seen_batches"]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


# -- 7. the UvA tutorials' GenerateCallback: pl_module.eval(), pl_module(x), hparams ----------


class DropoutBNNet(L.LightningModule):
    def __init__(self, latent_dim: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(
            nn.Linear(8, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(16, latent_dim),
        )
        self.decoder = nn.Sequential(nn.Linear(latent_dim, 16), nn.ReLU(), nn.Linear(16, 8))
        self.example_input_array = torch.zeros(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = F.mse_loss(self(x), x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class GenerateCallback(L.Callback):
    """As in the UvA autoencoder tutorial: at every epoch's end, reconstruct fixed inputs
    in eval mode and put the module back in train mode."""

    def __init__(self, input_imgs: torch.Tensor) -> None:
        super().__init__()
        self.input_imgs = input_imgs
        self.seen: list[tuple[int, torch.Tensor, bool]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        input_imgs = self.input_imgs.to(pl_module.device)
        with torch.no_grad():
            pl_module.eval()
            reconst_imgs = pl_module(input_imgs)
            pl_module.train()
        latent = pl_module.hparams.latent_dim
        self.seen.append((latent, reconst_imgs.clone(), pl_module.encoder[3].training))


# -- 8. predict_step returning a dict, written by a BasePredictionWriter --------------------


class DictPredictor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        x, y = batch
        probs = self.net(x).softmax(-1)
        return {"preds": probs.argmax(-1), "probs": probs, "target": y}

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class CollectWriter(BasePredictionWriter):
    """Keeps what ``write_on_batch_end`` and ``write_on_epoch_end`` receive."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.batches: list[tuple[int, dict[str, Any]]] = []
        self.epoch: list[Any] = []

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.batches.append((batch_idx, prediction))

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: Any, predictions: Any, batch_indices: Any
    ) -> None:
        self.epoch.append(predictions)


# -- 9. a DataModule whose setup(stage) the module reads; its on_after_batch_transfer scales ---


class PixelData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_classes: int | None = None

    def setup(self, stage: str) -> None:
        if stage == "fit" or stage is None:
            self.train_set = Pixels(32, 0)
            self.val_set = Pixels(16, 1)
            self.num_classes = int(self.train_set.labels.max()) + 1

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch["image"] = batch["image"].float() / 255.0
        return batch


class HeadFromDataModule(L.LightningModule):
    """The head is sized in ``setup`` from ``self.trainer.datamodule.num_classes``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head: nn.Module | None = None

    def setup(self, stage: str) -> None:
        if self.head is None:
            self.head = nn.Linear(16, self.trainer.datamodule.num_classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.head(self.body(batch["image"])), batch["label"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self.head(self.body(batch["image"]))
        acc = (logits.argmax(-1) == batch["label"]).float().mean()
        self.log("val_acc", acc)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# -- 10. Lightning docs' learning-rate warm-up in an overridden optimizer_step -----------------


class WarmupInOptimizerStep(L.LightningModule):
    def __init__(self, learning_rate: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any
    ) -> None:
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 500:
            lr_scale = min(1.0, float(self.trainer.global_step + 1) / 500.0)
            for pg in optimizer.param_groups:
                pg["lr"] = lr_scale * self.hparams.learning_rate


class TimmScheduler(WarmupInOptimizerStep):
    """timm's schedulers step with ``scheduler.step(epoch=...)``: ``lr_scheduler_step``."""

    optimizer_step = L.LightningModule.optimizer_step

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step(epoch=self.current_epoch)


# -- 11. ReduceLROnPlateau on a validation metric, validated every other epoch ----------------


class PlateauEveryOtherEpoch(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=0.5, patience=0, threshold=0.5
        )
        # frequency 2 with check_val_every_n_epoch=2, as Lightning's docs ask
        config = {"scheduler": scheduler, "monitor": "val_loss", "interval": "epoch"}
        return {"optimizer": optimizer, "lr_scheduler": config | {"frequency": 2}}


# -- 12. from_torch: a mixture of experts in a ParameterList / ParameterDict -----------------


class MixtureOfExperts(nn.Module):
    """Experts as raw weights in a ``ParameterList``, a gate and bias in a ``ParameterDict``."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.randn(8, 4) * 0.3) for _ in range(experts)]
        )
        self.gate = nn.ParameterDict(
            {
                "w": nn.Parameter(torch.randn(8, experts) * 0.3),
                "b": nn.Parameter(torch.zeros(experts)),
            }
        )
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(x @ self.gate["w"] + self.gate["b"], dim=-1)
        outs = torch.stack([x @ w for w in self.experts], dim=1)
        return self.out(torch.relu((gates[..., None] * outs).sum(1)))
