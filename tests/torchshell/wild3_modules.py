"""LightningModules written the way public projects write them, for test_port_wild3.py.

Each is trained in plain Lightning and through ``JaxModule.from_lightning`` on the same
loaders; nothing here knows about coreshell.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import Dataset, TensorDataset

# -- data ---------------------------------------------------------------------------------------


def table(n: int, seed: int, features: int = 8) -> TensorDataset:
    """``(x[features], y in 0..2)`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


class Sentences(Dataset):
    """Variable-length token rows padded to 10, their lengths and a label (tuples)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, 11, (n,), generator=g)
        self.tokens = torch.randint(1, 30, (n, 10), generator=g)
        self.tokens[torch.arange(10)[None, :] >= self.lengths[:, None]] = 0
        self.labels = (self.tokens[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.lengths[i], self.labels[i]


class Encoded(Dataset):
    """Tokenizer-style dict rows: ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, n: int, seed: int) -> None:
        self.s = Sentences(n, seed)

    def __len__(self) -> int:
        return len(self.s)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens, length, label = self.s[i]
        return {
            "input_ids": tokens,
            "attention_mask": (torch.arange(10) < length).long(),
            "labels": label,
        }


# -- 1. torchmetrics objects in training and validation, log_dict, ([opt], [sched]) ------------


class MetricsClassifier(L.LightningModule):
    def __init__(self, lr: float = 1e-2, num_classes: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits.argmax(dim=1), y)
        self.log_dict(
            {"train_loss": loss, "train_acc": self.train_acc},
            prog_bar=True,
            on_step=True,
            on_epoch=True,
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.val_f1(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_f1", self.val_f1, on_epoch=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2)
        return [opt], [sched]


# -- 2. an autoencoder returning a dict, example_input_array, SGD nesterov + MultiStepLR -------


class AutoEncoder(L.LightningModule):
    def __init__(self, latent: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(2, 8)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, latent))
        self.decoder = nn.Sequential(nn.Linear(latent, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, _ = batch
        x_hat = self(x)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return {"loss": loss, "recon": x_hat.detach()}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("val_mse", F.mse_loss(self(x), x))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(
            self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4
        )
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.3)
        return {"optimizer": opt, "lr_scheduler": sched}


class ReconSeen(L.Callback):
    """Keeps the shape and mean of what ``training_step`` returned beside its loss."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], float, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        recon = outputs["recon"]
        self.seen.append((tuple(recon.shape), float(recon.mean()), float(outputs["loss"])))


# -- 3. validation outputs gathered on self, aggregated at the epoch end; trainer reads -------


class GatheredValidation(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.validation_step_outputs: list[dict[str, torch.Tensor]] = []
        self.printed: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.trainer.is_global_zero:
            self.log("train_loss", loss, prog_bar=True)
        return loss * (1.0 + 0.5 * self.current_epoch)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        out = {"loss": F.cross_entropy(logits, y), "preds": logits.argmax(-1), "target": y}
        self.validation_step_outputs.append(out)
        return out

    def on_validation_epoch_end(self) -> None:
        outs = self.validation_step_outputs
        preds = torch.cat([o["preds"] for o in outs])
        target = torch.cat([o["target"] for o in outs])
        acc = (preds == target).float().mean()
        loss = torch.stack([o["loss"] for o in outs]).mean()
        self.log_dict({"val_acc": acc, "val_loss": loss}, prog_bar=True)
        onehot = F.one_hot(preds, num_classes=3).sum(0)
        self.log("val_pred_class0", onehot[0].float())
        if self.trainer.is_global_zero:
            self.print(f"epoch {self.current_epoch}: val_acc={acc:.4f}")
            self.printed.append(f"{self.current_epoch}:{float(acc):.6f}")
        self.validation_step_outputs.clear()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


# -- 4. a transformer encoder text classifier, the AdamW no_decay pattern, HF-style warmup ---


class TextClassifier(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup_steps: int = 2, weight_decay: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.embeddings = nn.Embedding(30, 16, padding_idx=0)
        self.position = nn.Parameter(torch.randn(1, 10, 16) * 0.02)
        layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.LayerNorm = nn.LayerNorm(16)
        self.classifier = nn.Linear(16, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids) + self.position
        h = self.encoder(h, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.classifier(self.LayerNorm(pooled))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"], label_smoothing=0.05)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"])
        self.log("val_loss", F.cross_entropy(logits, batch["labels"]))

    def configure_optimizers(self) -> Any:
        no_decay = ["bias", "LayerNorm.weight", "norm1.weight", "norm2.weight"]
        grouped = [
            {
                "params": [
                    p for n, p in self.named_parameters() if not any(nd in n for nd in no_decay)
                ],
                "weight_decay": self.hparams.weight_decay,
            },
            {
                "params": [
                    p for n, p in self.named_parameters() if any(nd in n for nd in no_decay)
                ],
                "weight_decay": 0.0,
            },
        ]
        opt = torch.optim.AdamW(grouped, lr=self.hparams.lr, eps=1e-8)
        total = self.trainer.estimated_stepping_batches
        warmup = self.hparams.warmup_steps

        def lr_lambda(step: int) -> float:  # transformers' get_linear_schedule_with_warmup
            if step < warmup:
                return float(step) / float(max(1, warmup))
            return max(0.0, float(total - step) / float(max(1, total - warmup)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1},
        }


# -- 5. a frozen backbone (requires_grad=False), optimizer over the trainable ones ---------


class FrozenBackbone(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        for p in self.backbone.parameters():
            p.requires_grad = False
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = filter(lambda p: p.requires_grad, self.parameters())
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# -- 6. a GRU language model with tied embedding weights --------------------------------------


class TiedLM(L.LightningModule):
    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.encoder.weight  # weight tying (Press & Wolf)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.encoder(tokens))
        return self.decoder(out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(
            logits.reshape(-1, self.hparams.vocab), tokens[:, 1:].reshape(-1), ignore_index=0
        )
        self.log("train_loss", loss)
        self.log("train_ppl", torch.exp(loss))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# -- 7. buffers updated in place in training_step -------------------------------------------


class RunningNorm(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.running_mean)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.seen += x.size(0)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 8. the optimizer over self.trainer.model.parameters() (FSDP-style docs pattern) --------


class TrainerModelParams(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2)


# -- 9. a VAE: reparameterisation noise drawn in training_step ------------------------------


class VAE(L.LightningModule):
    def __init__(self, latent: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.enc = nn.Linear(8, 16)
        self.mu = nn.Linear(16, latent)
        self.logvar = nn.Linear(16, latent)
        self.dec = nn.Sequential(nn.Linear(latent, 16), nn.ReLU(), nn.Linear(16, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        h = F.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        z = mu + eps * std
        recon = F.mse_loss(self.dec(z), x, reduction="sum") / x.size(0)
        kld = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
        self.log_dict({"recon": recon, "kld": kld, "eps_mean": eps.mean()})
        return recon + kld

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 10. token classification over the active (unpadded) positions: boolean indexing -------


class ActiveTokens(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16, padding_idx=0)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        active = batch["attention_mask"].view(-1) == 1
        active_logits = logits.view(-1, 4)[active]
        active_labels = (batch["input_ids"] % 4).view(-1)[active]
        loss = F.cross_entropy(active_logits, active_labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# -- 11. the network passed in, save_hyperparameters(ignore=...), MetricCollection in training


class Injected(L.LightningModule):
    def __init__(self, model: nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        metrics = torchmetrics.MetricCollection(
            {
                "acc": torchmetrics.Accuracy(task="multiclass", num_classes=3),
                "prec": torchmetrics.Precision(task="multiclass", num_classes=3, average="macro"),
            }
        )
        self.train_metrics = metrics.clone(prefix="train_")
        self.val_metrics = metrics.clone(prefix="val_")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        self.log_dict(self.train_metrics(logits, y), on_step=True, on_epoch=False)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_metrics.update(self.model(x), y)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute())
        self.val_metrics.reset()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ChainedScheduler([warm, decay]),
                "interval": "step",
            },
        }


# -- 12. a layer built in configure_model / setup, a LazyLinear head -------------------------


class BuiltInSetup(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body: nn.Module | None = None
        self.head = nn.LazyLinear(3)
        self.example_input_array = torch.zeros(2, 8)

    def configure_model(self) -> None:
        if self.body is None:
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 13. a training_step that skips a batch by returning None ---------------------------------


class SkipsNonFinite(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if not torch.isfinite(loss):
            return None
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LazyNoExample(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BuiltInSetupHook(L.LightningModule):
    """The head built in ``setup(stage)`` from the data (the pre-configure_model pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head: nn.Module | None = None

    def setup(self, stage: str) -> None:
        if self.head is None:
            loader = self.trainer.fit_loop._data_source.dataloader()
            classes = int(loader.dataset.tensors[1].max()) + 1
            self.head = nn.Linear(16, classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.body(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class UnfreezesLater(L.LightningModule):
    """Backbone frozen for the first epoch, unfrozen in a hook (optimizer over every param)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.backbone.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.backbone.requires_grad_(True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FreezesOnTrainStart(L.LightningModule):
    """The backbone frozen in ``on_train_start`` (Adam over every parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def on_train_start(self) -> None:
        self.backbone.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)
