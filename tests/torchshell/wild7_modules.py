"""LightningModules, ``nn.Module``s and datasets written the way public projects write them
(round 7): DANN's gradient reversal layer and a quantizer's straight-through estimator
(``torch.autograd.Function``s with their own backward), a streaming ``IterableDataset`` with
no ``__len__``, a ``Dataset`` of numpy float64 arrays and python floats (default_collate
gives float64 tensors), ESPCN super-resolution (``PReLU``, ``InstanceNorm2d``,
``PixelShuffle``), a ``@torch.jit.script`` activation and a ``@torch.jit.ignore`` method,
forward hooks collecting activations for deep supervision, ``nn.Embedding(max_norm=...)``, a
siamese network on ``CosineEmbeddingLoss`` and ``MarginRankingLoss``, a Gaussian regression
head on ``GaussianNLLLoss`` and ``HuberLoss``, a padded transformer collate (``pad_sequence``
into a namedtuple batch, ``src_key_padding_mask``, a non-persistent sinusoidal buffer, tied
embeddings, transformers' ``get_cosine_schedule_with_warmup`` per step), Gumbel-softmax
codes, ``Tensor.register_hook`` in a step, a spatial transformer (``affine_grid``/
``grid_sample``), an actor-critic on ``torch.distributions`` (``Categorical``, ``Normal``,
``kl_divergence``), an RNN under the ``orthogonal`` parametrization, fine-tuning's
``set_grad_enabled``/``inference_mode`` regions and WGAN-GP's gradient penalty
(``torch.autograd.grad``, ``torch.func.vjp``/``grad``), for
test_port_wild7.py. Nothing here knows about coreshell."""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset, IterableDataset, TensorDataset

# -- data ---------------------------------------------------------------------------------------


def table(n: int, seed: int, features: int = 8) -> TensorDataset:
    """``(x[features], y in 0..2)`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


def domains(n: int, seed: int) -> TensorDataset:
    """DANN rows ``(x[8], class in 0..2, domain in 0..1)``: the second half shifted."""
    x, y = table(n, seed).tensors
    d = (torch.arange(n) % 2).long()
    return TensorDataset(x + d[:, None] * 0.5, y, d)


class Stream(IterableDataset):
    """Rows read one by one from a generator (a file or a socket in real life): no
    ``__len__``, so the loader has no length either."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.n, self.seed = n, seed

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.n):
            x = torch.randn(8, generator=g)
            yield x, x[:3].sum() - x[3]


class NumpyRows(Dataset):
    """A pandas/sklearn style dataset: numpy float64 features, a python float target."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 8))  # float64
        self.y = [float(r[0] - 2 * r[1]) for r in self.x]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[np.ndarray, float]:
        return self.x[i], self.y[i]


def regression(n: int, seed: int) -> TensorDataset:
    """``(x[8], target)`` rows."""
    x, _ = table(n, seed).tensors
    return TensorDataset(x, x[:, 0] - 2 * x[:, 1] + 0.1 * x[:, 2] ** 2)


def images(n: int, seed: int) -> TensorDataset:
    """Super-resolution pairs ``(low[1, 4, 4], high[1, 8, 8])``."""
    g = torch.Generator().manual_seed(seed)
    high = torch.rand(n, 1, 8, 8, generator=g)
    return TensorDataset(F.avg_pool2d(high, 2), high)


def pairs(n: int, seed: int) -> TensorDataset:
    """Siamese rows ``(a[8], b[8], +1 similar / -1 not)``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 8, generator=g)
    same = torch.rand(n, generator=g) > 0.5
    b = torch.where(same[:, None], a + 0.1 * torch.randn(n, 8, generator=g), -a)
    return TensorDataset(a, b, same.float() * 2 - 1)


class Sentences(Dataset):
    """Token lists of length 3..8 (ids 1..19, 0 is padding) and a label."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(3, 9, (1,), generator=g))
            ids = torch.randint(1, 20, (length,), generator=g)
            self.rows.append((ids, int(ids[0] > 10)))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.rows[i]


Batch = namedtuple("Batch", ["tokens", "lengths", "labels"])


def pad_collate(rows: list[tuple[torch.Tensor, int]]) -> Batch:
    """The collate of countless tutorials: ``pad_sequence`` to the longest row."""
    tokens = pad_sequence([r[0] for r in rows], batch_first=True, padding_value=0)
    tokens = F.pad(tokens, (0, 8 - tokens.shape[1]))  # one width: 8
    lengths = torch.tensor([len(r[0]) for r in rows])
    return Batch(tokens, lengths, torch.tensor([r[1] for r in rows]))


# -- 1. DANN: a gradient reversal layer -------------------------------------------------------


class GradReverse(torch.autograd.Function):
    """Ganin & Lempitsky's gradient reversal: identity forward, ``-alpha * grad`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return grad_output.neg() * ctx.alpha, None


class DANN(L.LightningModule):
    def __init__(self, alpha: float = 0.5) -> None:
        super().__init__()
        self.alpha = alpha
        self.features = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.classifier = nn.Linear(16, 3)
        self.domain = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, d = batch
        h = self.features(x)
        class_loss = F.cross_entropy(self.classifier(h), y)
        domain_loss = F.cross_entropy(self.domain(GradReverse.apply(h, self.alpha)), d)
        loss = class_loss + domain_loss
        self.log_dict({"class_loss": class_loss, "domain_loss": domain_loss, "train_loss": loss})
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RoundSTE(torch.autograd.Function):
    """Quantization-aware training's straight-through estimator: rounds to a grid in the
    forward, passes the gradient through unchanged in the backward (torch 2's
    ``setup_context`` style)."""

    @staticmethod
    def forward(x: torch.Tensor, levels: int) -> torch.Tensor:
        return torch.round(x * levels) / levels

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.levels = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return grad_output, None


class QuantNet(nn.Module):
    """From a torch training loop: ``Linear - Tanh - fake-quantize - Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(RoundSTE.apply(torch.tanh(self.fc1(x)), 4))


# -- 2. a streaming regressor ---------------------------------------------------------------------


class StreamRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 3. numpy float64 rows ------------------------------------------------------------------------


class NumpyRegressor(L.LightningModule):
    """Casts the float64 batch as the tutorials do (``x.float()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.net(x.float()).squeeze(-1)
        loss = F.l1_loss(pred, y.float())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class NumpyRegressorUncast(NumpyRegressor):
    """Forgets the cast: torch stops at ``mat1 and mat2 must have the same dtype``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.l1_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss


class DoubleRegressor(NumpyRegressor):
    """Trains in float64 on purpose (``self.double()``), as scientific code does."""

    def __init__(self) -> None:
        super().__init__()
        self.double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss


# -- 4. ESPCN super-resolution --------------------------------------------------------------------


class ESPCN(L.LightningModule):
    def __init__(self, upscale: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.InstanceNorm2d(8, affine=True),
            nn.PReLU(8),
            nn.Conv2d(8, upscale**2, 3, padding=1),
            nn.PixelShuffle(upscale),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + F.interpolate(x, scale_factor=2, mode="nearest")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        low, high = batch
        loss = F.l1_loss(self(low), high)
        self.log("train_loss", loss)
        self.log("psnr", 10 * torch.log10(1 / F.mse_loss(self(low), high)))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        low, high = batch
        self.log("val_l1", F.l1_loss(self(low), high))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 5. TorchScript: a scripted activation and an ignored method ------------------------------


@torch.jit.script
def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Megatron's fused bias + tanh-GELU."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class ScriptedMLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.bias = nn.Parameter(torch.zeros(16))
        self.fc2 = nn.Linear(16, 3)

    @torch.jit.ignore
    def debug_stats(self, h: torch.Tensor) -> torch.Tensor:
        return h.abs().mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(bias_gelu(self.bias, self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        self.log("act", self.debug_stats(self.fc1(x)))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 6. deep supervision through forward hooks -----------------------------------------------


class HookedSupervision(L.LightningModule):
    """Collects intermediate activations with ``register_forward_hook`` (the feature
    extraction recipe) and puts an auxiliary head on one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
        )
        self.aux = nn.Linear(16, 3)
        self.activations: dict[str, torch.Tensor] = {}
        self.backbone[1].register_forward_hook(self._save("early"))

    def _save(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            self.activations[name] = output

        return hook

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.backbone(x)
        aux = self.aux(self.activations["early"])
        loss = F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(aux, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


# -- 7. an embedding with max_norm -----------------------------------------------------------


class MaxNormBag(L.LightningModule):
    """``nn.Embedding(max_norm=1.0)`` renormalises the rows it looks up, in place, in every
    forward (torch's ``embedding_renorm_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # rows start past the norm
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.head(self.emb(batch.tokens).mean(1)), batch.labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# -- 8. siamese and probabilistic regression losses ----------------------------------------------


class Siamese(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.scorer = nn.Linear(4, 1)
        self.cosine = nn.CosineEmbeddingLoss(margin=0.2)
        self.ranking = nn.MarginRankingLoss(margin=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        a, b, target = batch
        za, zb = self.encoder(a), self.encoder(b)
        cos = self.cosine(za, zb, target)
        rank = self.ranking(self.scorer(za).squeeze(-1), self.scorer(zb).squeeze(-1), target)
        loss = cos + rank
        self.log_dict({"cosine": cos, "ranking": rank, "train_loss": loss})
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class GaussianHead(L.LightningModule):
    """Predicts a mean and a variance (``softplus``): ``GaussianNLLLoss`` plus a Huber term."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.mean = nn.Linear(16, 1)
        self.var = nn.Linear(16, 1)
        self.nll = nn.GaussianNLLLoss(eps=1e-4)
        self.huber = nn.HuberLoss(delta=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.body(x)
        mu, var = self.mean(h).squeeze(-1), F.softplus(self.var(h)).squeeze(-1)
        loss = self.nll(mu, y, var) + self.huber(mu, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 9. a padded transformer: pad_sequence, key padding, sinusoidal buffer, tied weights --------


class PositionalEncoding(nn.Module):
    """The PyTorch tutorial's sinusoidal encoding, kept out of the checkpoint."""

    def __init__(self, d_model: int, max_len: int = 16) -> None:
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(1)]


class PaddedTransformer(L.LightningModule):
    """Classifies and reconstructs (a tied output projection) padded token rows."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(20, 16, padding_idx=0)
        self.pos = PositionalEncoding(16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.lm_head = nn.Linear(16, 20, bias=False)
        self.lm_head.weight = self.embed.weight
        self.cls = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Any:
        pad = torch.arange(tokens.size(1))[None, :] >= lengths[:, None]
        h = self.encoder(self.pos(self.embed(tokens) * math.sqrt(16)), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.cls((h * keep).sum(1) / keep.sum(1)), self.lm_head(h)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        logits, lm = self(batch.tokens, batch.lengths)
        cls_loss = F.cross_entropy(logits, batch.labels)
        lm_loss = F.cross_entropy(lm.transpose(1, 2), batch.tokens, ignore_index=0)
        loss = cls_loss + 0.5 * lm_loss
        self.log("train_loss", loss, batch_size=len(batch.labels))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits, _ = self(batch.tokens, batch.lengths)
        acc = (logits.argmax(-1) == batch.labels).float().mean()
        self.log("val_acc", acc, batch_size=len(batch.labels))

    def configure_optimizers(self) -> Any:
        from transformers import get_cosine_schedule_with_warmup

        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=2, num_training_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- 10. Gumbel-softmax codes ---------------------------------------------------------------------


class GumbelCodes(L.LightningModule):
    """Discrete codes with ``F.gumbel_softmax(hard=True)`` (its noise from ``exponential_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 6)
        self.dec = nn.Linear(6, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        codes = F.gumbel_softmax(self.enc(x), tau=0.5, hard=True)
        loss = F.mse_loss(self.dec(codes), x)
        self.log("train_loss", loss)
        self.log("code_use", codes.mean(0).max())
        self.log("noise_mean", torch.empty(4096, device=self.device).exponential_().mean())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- 11. a gradient hook registered in forward ------------------------------------------------


class GradHookScale(L.LightningModule):
    """Scales the gradient through the shared trunk with ``Tensor.register_hook`` (Grad-CAM
    and multi-head detection codebases hook activations this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.trunk(x))
        h.register_hook(lambda grad: grad * 0.1)
        loss = F.cross_entropy(self.head(h), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 12. a spatial transformer network (the PyTorch tutorial) ------------------------------------


class SpatialTransformer(L.LightningModule):
    """``F.affine_grid`` + ``F.grid_sample`` in front of a small classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 6))
        self.loc[-1].weight.data.zero_()
        self.loc[-1].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))

    def stn(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        return F.grid_sample(x, grid, align_corners=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.nll_loss(F.log_softmax(self.head(self.stn(x.view(-1, 1, 8, 8))), dim=1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


# -- 13. a policy and a value head on torch.distributions ------------------------------------


class ActorCritic(L.LightningModule):
    """Offline actor-critic on logged ``(state, action, return)`` rows: ``Categorical``
    log-probabilities and entropy, a ``Normal`` head's ``log_prob`` and KL to a prior, and
    the policy's own ``sample()`` logged."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.pi = nn.Linear(16, 3)
        self.mu = nn.Linear(16, 1)
        self.log_std = nn.Parameter(torch.zeros(1))
        self.v = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        state, action, ret = batch
        h = self.body(state)
        dist = torch.distributions.Categorical(logits=self.pi(h))
        value = self.v(h).squeeze(-1)
        advantage = (ret - value).detach()
        normal = torch.distributions.Normal(self.mu(h).squeeze(-1), self.log_std.exp())
        prior = torch.distributions.Normal(torch.zeros_like(ret), torch.ones_like(ret))
        kl = torch.distributions.kl_divergence(normal, prior).mean()
        loss = (
            -(dist.log_prob(action) * advantage).mean()
            - 0.01 * dist.entropy().mean()
            + 0.5 * F.mse_loss(value, ret)
            - normal.log_prob(ret).mean() * 0.1
            + 0.01 * kl
        )
        self.log_dict({"train_loss": loss, "kl": kl})
        self.log("sampled_action", dist.sample().float().mean())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def rollouts(n: int, seed: int) -> TensorDataset:
    """Logged ``(state[8], action in 0..2, return)`` rows."""
    x, y = table(n, seed).tensors
    return TensorDataset(x, y, x[:, 0] - 0.5 * x[:, 2])


class OrthogonalRNN(L.LightningModule):
    """An RNN whose recurrent matrix is kept orthogonal by
    ``torch.nn.utils.parametrizations.orthogonal``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 8, batch_first=True)
        torch.nn.utils.parametrizations.orthogonal(self.rnn, "weight_hh_l0")
        self.head = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out, _ = self.rnn(x.view(-1, 2, 4))
        loss = F.cross_entropy(self.head(out[:, -1]), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 14. grad-mode regions: a frozen encoder and an accuracy under inference_mode ------------


class FineTuner(L.LightningModule):
    """Fine-tuning code's ``torch.set_grad_enabled(not self.freeze_encoder)`` around the
    encoder, and a training accuracy computed under ``torch.inference_mode()``."""

    def __init__(self, freeze_encoder: bool = True) -> None:
        super().__init__()
        self.freeze_encoder = freeze_encoder
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.set_grad_enabled(not self.freeze_encoder):
            h = self.encoder(x)
        logits = self.head(h)
        loss = F.cross_entropy(logits, y)
        with torch.inference_mode():
            acc = (self.head(self.encoder(x)).argmax(-1) == y).float().mean()
        self.log("train_loss", loss)
        self.log("train_acc", acc)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


# -- 15. gradient penalties: torch.autograd.grad and torch.func ------------------------------


class CriticGP(L.LightningModule):
    """A WGAN-GP critic step as GAN repositories write it: the penalty from
    ``torch.autograd.grad(..., create_graph=True)`` on interpolated samples."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def interpolate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fake = x.flip(0) * 0.5
        alpha = torch.linspace(0, 1, x.size(0), device=self.device)[:, None]
        return fake, alpha * x + (1 - alpha) * fake

    def penalty(self, interp: torch.Tensor) -> torch.Tensor:
        interp = interp.requires_grad_(True)
        out = self.critic(interp)
        (grads,) = torch.autograd.grad(
            outputs=out, inputs=interp, grad_outputs=torch.ones_like(out), create_graph=True
        )
        return ((grads.norm(2, dim=1) - 1) ** 2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        fake, interp = self.interpolate(x)
        gp = self.penalty(interp)
        loss = self.critic(fake).mean() - self.critic(x).mean() + 10 * gp
        self.log_dict({"train_loss": loss, "gp": gp})
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3, betas=(0.5, 0.9))


class CriticGPFunc(CriticGP):
    """The same penalty with ``torch.func.vjp``, and an R1 term with ``torch.func.grad``."""

    def penalty(self, interp: torch.Tensor) -> torch.Tensor:
        out, vjp_fn = torch.func.vjp(self.critic, interp)
        (grads,) = vjp_fn(torch.ones_like(out))
        r1 = torch.func.grad(lambda z: self.critic(z).sum())(interp)
        return ((grads.norm(2, dim=1) - 1) ** 2).mean() + 0.1 * r1.pow(2).sum(1).mean()
