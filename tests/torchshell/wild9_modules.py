"""Modules written as public projects write them (round 9; data in wild9_data.py): DeepSurv
(``logcumsumexp``), a ``torch.distributions`` VAE, ``BatchNorm1d(momentum=None)``/GroupNorm/
RMSNorm, NaN-as-missing features, ModuleDict heads by a task string, CLIP's ``logit_scale``,
a Conv1d audio net, a LLaMA-style block, module hooks, ``configure_gradient_clipping``,
``AdaptiveLogSoftmaxWithLoss``, ``nn.Embedding(scale_grad_by_freq=True | sparse=True)``."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.torchshell.wild9_data import TASKS

# -- modules --------------------------------------------------------------------------------


class DeepSurv(L.LightningModule):
    """pycox/DeepSurv: risk scores sorted by descending time, Cox's negative partial
    log-likelihood through ``logcumsumexp`` over the risk set."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.SELU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, time, event = batch
        risk = self.net(x).squeeze(-1)
        order = torch.argsort(time, descending=True)
        risk, event = risk.gather(0, order), event[order]
        log_risk_set = torch.logcumsumexp(risk, dim=0)
        loss = -((risk - log_risk_set) * event).sum() / event.sum().clamp(min=1.0)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class DistributionsVAE(L.LightningModule):
    """A VAE on ``torch.distributions``: ``Independent(Normal)`` posterior, ``rsample``,
    ``kl_divergence`` to a standard normal prior, KL annealed by ``self.global_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
        self.dec = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        mu, log_std = self.enc(x).chunk(2, dim=-1)
        q = torch.distributions.Independent(torch.distributions.Normal(mu, log_std.exp()), 1)
        prior = torch.distributions.Independent(
            torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu)), 1
        )
        z = q.rsample()
        recon = F.mse_loss(self.dec(z), x)
        kl = torch.distributions.kl_divergence(q, prior).mean()
        beta = min(1.0, self.global_step / 4)
        self.log_dict({"recon": recon, "kl": kl, "beta": beta, "z_mean": z.mean()})
        return recon + beta * kl

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Norms(nn.Module):
    """``BatchNorm1d(momentum=None)`` (running stats as a cumulative average over
    ``num_batches_tracked``), ``GroupNorm``, ``nn.RMSNorm`` and a bias-free ``LayerNorm``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.gn = nn.GroupNorm(2, 8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.ln = nn.LayerNorm(8, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.bn(self.fc1(x))))
        return self.out(self.ln(self.rms(h) + h))


class LitNorms(L.LightningModule):
    """:class:`Norms` in a LightningModule, logging a running statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Norms()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class MissingValues(L.LightningModule):
    """Imputes NaN features with a learned value and a missing-indicator, and skips rows
    whose target is NaN in a masked Smooth-L1 mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(6))
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        gap = torch.isnan(x)
        x = torch.where(gap, self.fill.expand_as(x), x)
        pred = self.net(torch.cat([x, gap.float()], dim=-1)).squeeze(-1)
        valid = ~torch.isnan(y)
        err = F.smooth_l1_loss(pred, y.nan_to_num(0.0), reduction="none", beta=0.5)
        loss = err.masked_fill(~valid, 0.0).sum() / valid.sum()
        self.log_dict({"train_loss": loss, "gaps": gap.float().mean()})
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class TaskHeads(L.LightningModule):
    """Multi-task heads in an ``nn.ModuleDict``, picked by the batch's ``task`` strings."""

    def __init__(self, per_task_log: bool = True) -> None:
        super().__init__()
        self.per_task_log = per_task_log
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = nn.ModuleDict({"sentiment": nn.Linear(16, 2), "topic": nn.Linear(16, 4)})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        task = batch["task"][0]
        loss = F.cross_entropy(self.heads[task](self.trunk(batch["x"])), batch["y"])
        self.log("train_loss", loss)
        if self.per_task_log:
            self.log(f"{task}_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CLIP(L.LightningModule):
    """Two towers, normalized embeddings, a learned ``logit_scale`` (clamped at 100) and the
    symmetric cross-entropy; AdamW without weight decay on the scale."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        img, txt = batch
        a = F.normalize(self.image(img), dim=-1)
        b = F.normalize(self.text(txt), dim=-1)
        logits = self.logit_scale.exp().clamp(max=100) * a @ b.t()
        labels = torch.arange(len(img), device=self.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        self.log_dict({"train_loss": loss, "scale": self.logit_scale.exp()})
        return loss

    def configure_optimizers(self) -> Any:
        towers = [p for n, p in self.named_parameters() if n != "logit_scale"]
        return torch.optim.AdamW(
            [{"params": towers}, {"params": [self.logit_scale], "weight_decay": 0.0}],
            lr=1e-2,
            weight_decay=0.1,
        )


class AudioNet(nn.Module):
    """Waveform classifier: reflect-padded Conv1d + GroupNorm, a linear downsample to 13
    frames, ConvTranspose1d, adaptive pools to 5 and 3 (13 divides neither)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 5, padding=2, padding_mode="reflect")
        self.norm = nn.GroupNorm(2, 4)
        self.up = nn.ConvTranspose1d(4, 4, 4, stride=2, padding=1)
        self.avg, self.max = nn.AdaptiveAvgPool1d(5), nn.AdaptiveMaxPool1d(3)
        self.head = nn.Linear(4 * 8, 3)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.conv(wave.unsqueeze(1))))
        h = F.interpolate(h, size=13, mode="linear", align_corners=False)
        h = F.relu(self.up(h))[..., :13]
        return self.head(torch.cat([self.avg(h), self.max(h)], dim=-1).flatten(1))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm attention written with ``einsum`` (rotary positions, a causal ``triu``
    mask built from ``x.size(1)``), then a SwiGLU MLP."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 32, bias=False), nn.Linear(dim, 32, bias=False)
        self.w2 = nn.Linear(32, dim, bias=False)

    @staticmethod
    def rotate(x: torch.Tensor) -> torch.Tensor:
        t, d = x.size(-2), x.size(-1)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
        angles = torch.outer(torch.arange(t, device=x.device).float(), inv)
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        pairs = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
        return x * cos + pairs * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k = self.rotate(q.transpose(1, 2)), self.rotate(k.transpose(1, 2))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.size(-1))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(L.LightningModule):
    """Next-token prediction on padded rows (``ignore_index=0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 16, padding_idx=0)
        self.block = LlamaBlock()
        self.out = nn.Linear(16, 16, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.out(self.block(self.embed(ids[:, :-1])))
        loss = F.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1), ignore_index=0)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Hooked(L.LightningModule):
    """Input standardisation in a forward pre-hook; the gradient into the trunk's last layer
    halved by a full backward hook (``grad_input`` replaced)."""

    def __init__(self, tensor_hook: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.trunk.register_forward_pre_hook(self.standardise)
        if tensor_hook:  # coreshell's fix: the same halving as a hook on the input tensor
            self.head.register_forward_pre_hook(self.halve_input)
        else:
            self.head.register_full_backward_hook(self.halve)

    @staticmethod
    def standardise(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (x,) = args
        return ((x - x.mean(0)) / (x.std(0) + 1e-5),)

    @staticmethod
    def halve(module: nn.Module, grad_input: Any, grad_output: Any) -> tuple[Any, ...]:
        return tuple(None if g is None else 0.5 * g for g in grad_input)

    @staticmethod
    def halve_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0].view_as(args[0])
        x.register_hook(lambda g: 0.5 * g)
        return (x,)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.trunk(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ClipsAfterFirstEpoch(L.LightningModule):
    """``configure_gradient_clipping`` overridden: no clipping in epoch 0, then norm 0.05
    through ``self.clip_gradients``; ``on_train_batch_start`` returns -1 at batch 3 (the rest
    of the epoch is skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx == 3 else None

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.current_epoch > 0:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class MatrixFactorization(nn.Module):
    """Dot-product recommender; ``scale_grad_by_freq`` divides each row's gradient by how
    often its id occurs in the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(6, 4, scale_grad_by_freq=True)
        self.items = nn.Embedding(8, 4, scale_grad_by_freq=True)
        self.bias = nn.Embedding(8, 1)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.users(user) * self.items(item)).sum(-1) + self.bias(item).squeeze(-1)


class TaskIdHeads(TaskHeads):
    """:class:`TaskHeads` reading the head's name from the batch's task id."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step({**batch, "task": [TASKS[int(batch["task"][0])]]}, batch_idx)


class NoClipOverride(ClipsAfterFirstEpoch):
    """coreshell's fix for the override: ``Trainer(gradient_clip_val=...)`` instead."""

    configure_gradient_clipping = L.LightningModule.configure_gradient_clipping


class AdaptiveSoftmaxLM(L.LightningModule):
    """A GRU language model on ``nn.AdaptiveLogSoftmaxWithLoss`` (frequent ids in the head,
    rare ones in tail clusters), as fairseq-era word models train."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.softmax = nn.AdaptiveLogSoftmaxWithLoss(16, 16, cutoffs=[4, 10], div_value=2.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        h, _ = self.rnn(self.embed(ids[:, :-1]))
        loss = self.softmax(h.reshape(-1, 16), ids[:, 1:].reshape(-1)).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class SparseFactorization(nn.Module):
    """The recommender with ``nn.Embedding(sparse=True)`` tables (SGD takes sparse grads)."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(6, 4, sparse=True), nn.Embedding(8, 4, sparse=True)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.users(user) * self.items(item)).sum(-1)


class AdaptiveHead(L.LightningModule):
    """Features to 16 classes through ``AdaptiveLogSoftmaxWithLoss``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.softmax = nn.AdaptiveLogSoftmaxWithLoss(16, 16, cutoffs=[4, 10], div_value=2.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.softmax(torch.tanh(self.proj(x)), y).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)
