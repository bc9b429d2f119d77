"""LightningModules and ``nn.Module``s written the way public projects write them (nanoGPT,
MoCo, knowledge distillation, timm's DropPath/LayerScale, torch_geometric-style message
passing, the PyTorch text-classification tutorial's EmbeddingBag, a U-Net, a seq2seq
decoder loop), for test_port_wild5.py. Nothing here knows about coreshell."""

from __future__ import annotations

import math
import random
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

# -- data ---------------------------------------------------------------------------------------


def table(n: int, seed: int, features: int = 8, classes: int = 3) -> TensorDataset:
    """``(x[features], y in 0..classes-1)`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()) % classes
    return TensorDataset(x, y)


def tokens(n: int, seed: int, length: int = 9, vocab: int = 16) -> TensorDataset:
    """Language-model rows ``(x[length], y[length])``, ``y`` shifted by one."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, length + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


class Graphs(Dataset):
    """Small graphs as torch_geometric keeps them: ``x[nodes, 4]``, ``edge_index[2, E]``."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            nodes = 5
            x = torch.randn(nodes, 4, generator=g)
            src = torch.randint(0, nodes, (8,), generator=g)
            dst = torch.randint(0, nodes, (8,), generator=g)
            label = int(x[:, 0].sum() > 0)
            self.items.append((x, torch.stack([src, dst]), label))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.items[i]


def collate_graphs(rows: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, Any]:
    """One disjoint big graph per batch: node offsets added to the edges, a ``batch`` vector."""
    xs, edges, batch, offset = [], [], [], 0
    for i, (x, edge_index, _) in enumerate(rows):
        xs.append(x)
        edges.append(edge_index + offset)
        batch.append(torch.full((len(x),), i, dtype=torch.long))
        offset += len(x)
    return {
        "x": torch.cat(xs),
        "edge_index": torch.cat(edges, 1),
        "batch": torch.cat(batch),
        "y": torch.tensor([label for *_, label in rows]),
    }


class News(Dataset):
    """Variable-length token lists and a label, as the text-classification tutorial has."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(2, 7, (1,), generator=g))
            text = torch.randint(0, 20, (length,), generator=g)
            self.rows.append((int(text[0] % 4), text.tolist()))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[int, list[int]]:
        return self.rows[i]


def collate_batch(batch: list[tuple[int, list[int]]]) -> tuple[Any, Any, Any]:
    """The tutorial's collate: labels, the concatenated text and each row's offset."""
    label_list, text_list, offsets = [], [], [0]
    for label, text in batch:
        label_list.append(label)
        processed = torch.tensor(text, dtype=torch.int64)
        text_list.append(processed)
        offsets.append(processed.size(0))
    labels = torch.tensor(label_list, dtype=torch.int64)
    offsets_t = torch.tensor(offsets[:-1]).cumsum(dim=0)
    return labels, torch.cat(text_list), offsets_t


class Shapes(Dataset):
    """Segmentation rows ``{"image": [1, 16, 16], "mask": [1, 16, 16]}`` (a bright square)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 1, 16, 16, generator=g) * 0.3
        self.masks = torch.zeros(n, 1, 16, 16)
        for i in range(n):
            r, c = (int(v) for v in torch.randint(0, 10, (2,), generator=g))
            self.masks[i, :, r : r + 6, c : c + 6] = 1.0
        self.images += self.masks

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "mask": self.masks[i]}


# -- nanoGPT: tril buffer, weight tying, decay groups by dim, warmup + cosine per step ---------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(
            dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 16, block_size: int = 9, n_embd: int = 16) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block(n_embd, 2, block_size) for _ in range(2)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * 2))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class LitGPT(L.LightningModule):
    def __init__(self, learning_rate: float = 3e-3, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in param_dict.values() if p.dim() >= 2]
        nodecay = [p for p in param_dict.values() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": nodecay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=(0.9, 0.95))
        total = int(self.trainer.estimated_stepping_batches)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - 2)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [2])
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


# -- MoCo: a momentum key encoder updated under no_grad, a queue with an integer pointer -------


class MoCo(L.LightningModule):
    def __init__(self, dim: int = 8, K: int = 32, m: float = 0.9, T: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder_q = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, dim))
        self.encoder_k = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, dim))
        for param_q, param_k in zip(
            self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True
        ):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        m = self.hparams.m
        for param_q, param_k in zip(
            self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True
        ):
            param_k.data = param_k.data * m + param_q.data * (1.0 - m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.hparams.K % batch_size == 0
        self.queue[:, ptr : ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.hparams.K
        self.queue_ptr[0] = ptr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        im_q, im_k = x * 0.9, x.flip(-1)  # two fixed "augmentations"
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.hparams.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=self.device)
        loss = F.cross_entropy(logits, labels)
        self._dequeue_and_enqueue(k)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.encoder_q.parameters(), lr=0.1, momentum=0.9)


class MoCoRolled(MoCo):
    """The queue pointer kept as a tensor: ``index_copy_`` at ``ptr + arange``, no ``int()``."""

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        batch_size = keys.shape[0]
        cols = (self.queue_ptr + torch.arange(batch_size, device=self.device)) % self.hparams.K
        self.queue.index_copy_(1, cols, keys.T)
        self.queue_ptr.add_(batch_size).remainder_(self.hparams.K)


# -- knowledge distillation: a frozen teacher put in eval once, its logits under no_grad -------


class Distiller(L.LightningModule):
    """Lightning 2's fit never calls ``.train()`` on the module: the teacher's Dropout and
    BatchNorm stay in the eval mode ``__init__`` set."""

    def __init__(self, temperature: float = 2.0, alpha: float = 0.7) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.teacher = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3)
        )
        self.student = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        self.teacher.requires_grad_(False)
        self.teacher.eval()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            t_logits = self.teacher(x)
        s_logits = self.student(x)
        T = self.hparams.temperature
        kd = F.kl_div(
            F.log_softmax(s_logits / T, dim=-1),
            F.softmax(t_logits / T, dim=-1),
            reduction="batchmean",
        ) * (T * T)
        ce = F.cross_entropy(s_logits, y)
        loss = self.hparams.alpha * kd + (1 - self.hparams.alpha) * ce
        self.log_dict({"kd": kd, "ce": ce, "train_loss": loss})
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.student(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.student.parameters(), lr=1e-2)


class LazyDistiller(Distiller):
    """The same, its student sized by ``example_input_array`` (a lazy first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3))
        self.example_input_array = torch.zeros(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


# -- focal loss with one_hot/gather, log_dict mixed on_step/on_epoch, warm restarts per step --


class FocalLoss(nn.Module):
    def __init__(self, alpha: list[float], gamma: float = 2.0) -> None:
        super().__init__()
        self.register_buffer("alpha", torch.tensor(alpha))
        self.gamma = gamma

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits, dim=-1)
        log_pt = log_p.gather(1, target.unsqueeze(1)).squeeze(1)
        pt = log_pt.exp()
        at = self.alpha.gather(0, target)
        one_hot = F.one_hot(target, num_classes=logits.shape[-1]).float()
        smooth = -(one_hot * log_p).sum(-1)  # the same CE through one_hot
        return (at * (1 - pt) ** self.gamma * smooth).mean()


class FocalClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 3))
        self.criterion = FocalLoss([0.25, 0.5, 0.25])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = self.criterion(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        conf = torch.where(logits.argmax(-1) == y, logits.softmax(-1).amax(-1), 0.0).mean()
        self.log_dict({"train_loss": loss, "conf": conf}, on_step=True, on_epoch=False)
        self.log_dict({"acc": acc, "loss_ep": loss}, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.RMSprop(self.parameters(), lr=1e-2, alpha=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2)
        return [opt], [{"scheduler": sched, "interval": "step"}]


# -- batch-hard triplet loss on torch.cdist distances ------------------------------------------


class TripletEmbedder(L.LightningModule):
    def __init__(self, margin: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        emb = self.embed(x)
        dist = torch.cdist(emb, emb)
        same = y.unsqueeze(0) == y.unsqueeze(1)
        hardest_pos = torch.where(same, dist, torch.zeros_like(dist)).amax(1)
        hardest_neg = torch.where(same, torch.full_like(dist, 1e4), dist).amin(1)
        loss = F.relu(hardest_pos - hardest_neg + self.hparams.margin).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


# -- message passing with index_add_ / scatter_add_ on torch_geometric-style batches -----------


class GraphNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin_in = nn.Linear(4, 16)
        self.msg = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> Any:
        h = F.relu(self.lin_in(x))
        src, dst = edge_index
        agg = torch.zeros_like(h).index_add_(0, dst, self.msg(h)[src])
        deg = torch.zeros(h.shape[0], device=h.device).scatter_add_(
            0, dst, torch.ones_like(dst, dtype=h.dtype)
        )
        h = F.relu(h + agg / deg.clamp(min=1).unsqueeze(-1))
        num_graphs = int(batch.max()) + 1
        pooled = torch.zeros(num_graphs, h.shape[1], device=h.device).index_add_(0, batch, h)
        counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1)
        return self.head(pooled / counts.unsqueeze(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch["x"], batch["edge_index"], batch["batch"])
        loss = F.cross_entropy(logits, batch["y"])
        self.log("train_loss", loss, batch_size=len(batch["y"]))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# -- the PyTorch text-classification tutorial: EmbeddingBag with offsets, SGD + StepLR ---------


class TextClassificationModel(nn.Module):
    def __init__(self, vocab_size: int = 20, embed_dim: int = 8, num_class: int = 4) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)
        self.fc = nn.Linear(embed_dim, num_class)
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.5
        self.embedding.weight.data.uniform_(-initrange, initrange)
        self.fc.weight.data.uniform_(-initrange, initrange)
        self.fc.bias.data.zero_()

    def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(text, offsets))


class LitNews(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TextClassificationModel()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        label, text, offsets = batch
        loss = F.cross_entropy(self.model(text, offsets), label)
        self.log("train_loss", loss, batch_size=len(label))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        label, text, offsets = batch
        logits = self.model(text, offsets)
        correct = (logits.argmax(1) == label).sum()
        self.log("val_acc", correct / len(label), batch_size=len(label))
        return {"correct": correct, "count": torch.tensor(len(label))}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=2.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.1)
        return [optimizer], [scheduler]


# -- a small U-Net: ConvTranspose2d, skip concat, interpolate, BCE + soft dice ----------------


class UNetLite(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU())
        self.bottom = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.dec = nn.Conv2d(8, 4, 3, padding=1)
        self.out = nn.Conv2d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = F.relu(self.bottom(F.max_pool2d(e2, 2)))
        b = F.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)
        d = self.up(b + e2)
        d = F.relu(self.dec(torch.cat([d, e1], dim=1)))
        return self.out(d)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch["image"])
        mask = batch["mask"]
        bce = F.binary_cross_entropy_with_logits(logits, mask)
        probs = torch.sigmoid(logits)
        inter = (probs * mask).sum(dim=(2, 3))
        dice = 1 - (2 * inter + 1) / (probs.sum(dim=(2, 3)) + mask.sum(dim=(2, 3)) + 1)
        loss = bce + dice.mean()
        self.log_dict({"train_loss": loss, "dice": dice.mean()}, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        lam = lambda epoch: 0.95**epoch  # noqa: E731
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lam)}


# -- timm-style ViT: patch embedding, cls token, LayerScale, DropPath (bernoulli_) ------------


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-1) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ViTBlock(nn.Module):
    def __init__(self, dim: int, drop_path_rate: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ls2 = LayerScale(dim)
        self.drop_path = DropPath(drop_path_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop_path(self.ls1(self.attn(h, h, h, need_weights=False)[0]))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class TinyViT(L.LightningModule):
    def __init__(self, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        dim = 16
        self.patch_embed = nn.Conv2d(1, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        dpr = [v.item() for v in torch.linspace(0, drop_path_rate, 2)]
        self.blocks = nn.Sequential(*[ViTBlock(dim, dpr[i]) for i in range(2)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch["image"].float() / 255.0, batch["label"]
        loss = F.cross_entropy(self(x), y, label_smoothing=0.1)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch["image"].float() / 255.0, batch["label"]
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        no_decay = ("cls_token", "pos_embed", "gamma")
        decay, skip = [], []
        for name, p in self.named_parameters():
            if p.ndim <= 1 or name.endswith(".bias") or any(k in name for k in no_decay):
                skip.append(p)
            else:
                decay.append(p)
        opt = torch.optim.AdamW(
            [{"params": skip, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.05}],
            lr=2e-3,
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=2e-3, total_steps=int(self.trainer.estimated_stepping_batches)
        )
        return [opt], [{"scheduler": sched, "interval": "step"}]


# -- seq2seq: GRU encoder, GRUCell decoder loop with dot attention, teacher forcing ------------


class Seq2Seq(L.LightningModule):
    def __init__(self, teacher_forcing_ratio: float = 1.0, vocab: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab, 16)
        self.encoder = nn.GRU(16, 16, batch_first=True)
        self.decoder = nn.GRUCell(32, 16)
        self.out = nn.Linear(32, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        src, tgt = batch
        enc_out, hidden = self.encoder(self.embedding(src))
        h = hidden[0]
        inp = torch.zeros_like(tgt[:, 0])  # <sos> = 0
        context = torch.zeros(src.shape[0], 16, device=self.device)
        losses = []
        for t in range(tgt.shape[1]):
            h = self.decoder(torch.cat([self.embedding(inp), context], -1), h)
            scores = torch.bmm(enc_out, h.unsqueeze(2)).squeeze(2)
            context = torch.bmm(F.softmax(scores, -1).unsqueeze(1), enc_out).squeeze(1)
            logits = self.out(torch.cat([h, context], -1))
            losses.append(F.cross_entropy(logits, tgt[:, t]))
            use_teacher_forcing = random.random() < self.hparams.teacher_forcing_ratio
            inp = tgt[:, t] if use_teacher_forcing else logits.argmax(-1).detach()
        loss = torch.stack(losses).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=5e-3)


class Seq2SeqTorchDraw(Seq2Seq):
    """Teacher forcing chosen per step with a torch draw and ``torch.where``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        src, tgt = batch
        enc_out, hidden = self.encoder(self.embedding(src))
        h = hidden[0]
        inp = torch.zeros_like(tgt[:, 0])
        context = torch.zeros(src.shape[0], 16, device=self.device)
        losses = []
        for t in range(tgt.shape[1]):
            h = self.decoder(torch.cat([self.embedding(inp), context], -1), h)
            scores = torch.bmm(enc_out, h.unsqueeze(2)).squeeze(2)
            context = torch.bmm(F.softmax(scores, -1).unsqueeze(1), enc_out).squeeze(1)
            logits = self.out(torch.cat([h, context], -1))
            losses.append(F.cross_entropy(logits, tgt[:, t]))
            force = torch.rand(()) < self.hparams.teacher_forcing_ratio
            inp = torch.where(force, tgt[:, t], logits.argmax(-1).detach())
        loss = torch.stack(losses).mean()
        self.log("train_loss", loss)
        return loss


# -- LSTM forecaster: hparams, explicit zero states on self.device, Huber, PolynomialLR --------


class Forecaster(L.LightningModule):
    def __init__(self, hidden: int = 16, num_layers: int = 2, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lstm = nn.LSTM(1, self.hparams.hidden, self.hparams.num_layers, batch_first=True)
        self.fc = nn.Linear(self.hparams.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.zeros(
            self.hparams.num_layers, x.size(0), self.hparams.hidden, device=self.device
        )
        c0 = torch.zeros(
            self.hparams.num_layers, x.size(0), self.hparams.hidden, device=self.device
        )
        out, _ = self.lstm(x.unsqueeze(-1), (h0, c0))
        return self.fc(out[:, -1, :]).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = F.huber_loss(self(x[:, :-1]), x[:, -1], delta=0.5)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, _ = batch
        pred = self(x[:, :-1])
        mae = (pred - x[:, -1]).abs().mean()
        self.log("val_mae", mae)
        return {"val_mae": mae, "pred": pred}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.PolynomialLR(
            opt, total_iters=int(self.trainer.estimated_stepping_batches), power=2.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- two optimizers under automatic optimization (Lightning 1.x's GAN style) ------------------


class TwoOptimizersAuto(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Linear(8, 8)
        self.disc = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return F.softplus(-self.disc(self.gen(x))).mean()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.gen.parameters(), lr=1e-3),
            torch.optim.Adam(self.disc.parameters(), lr=1e-3),
        ]


# -- plain nn.Modules for JaxModule.from_torch -------------------------------------------------


class DictOutputNet(nn.Module):
    """A forward returning a dict (transformers-style outputs) read by the user's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.cls = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.cls(h), "aux": self.aux(h).squeeze(-1)}


def dict_output_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"], y) + 0.1 * out["aux"].pow(2).mean()


class ConvGRUTagger(nn.Module):
    """A CRNN tagger: Conv1d features, a bidirectional 2-layer GRU, per-frame logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.gru = nn.GRU(8, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        out, _ = self.gru(h)
        return self.fc(out).transpose(1, 2)  # [B, C, T] for cross_entropy


class PaddedBagModel(nn.Module):
    """The tutorial's model on padded rows: ``EmbeddingBag(padding_idx=0)`` over ``[B, L]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(21, 8, mode="mean", padding_idx=0)
        self.fc = nn.Linear(8, 4)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(text))


def collate_padded(batch: list[tuple[int, list[int]]]) -> tuple[Any, Any]:
    """``(text[B, 6] shifted by one and padded with 0, label)``."""
    rows = [torch.tensor(text) + 1 for _, text in batch]
    text = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    text = F.pad(text, (0, 6 - text.shape[1]))
    return text, torch.tensor([label for label, _ in batch])


# -- spectral norm (torch.nn.utils.parametrizations): power iteration under no_grad ----------


class SpectralCritic(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.net = nn.Sequential(sn(nn.Linear(8, 16)), nn.LeakyReLU(0.2), sn(nn.Linear(16, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)
