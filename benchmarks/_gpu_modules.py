"""Three LightningModules as a PyTorch team writes them: plain torch, nothing of coreshell.

Each is sized like a well-known model and trains on synthetic data from a plain
``DataLoader``, with ``configure_optimizers`` returning ``torch.optim.AdamW``:

- :class:`WhisperEncoderClassifier`: Whisper-base's encoder (a conv stem over 3,000 log-mel
  frames down to 1,500, d=512, 6 pre-norm layers of ``nn.TransformerEncoder``, 8 heads, MLP
  2048), mean-pooled to a classifier;
- :class:`ViTClassifier`: ViT-B/16 at 224 px (a 16x16 patch conv, a class token, 12
  hand-written blocks calling ``F.scaled_dot_product_attention``, 12 heads, MLP 3072);
- :class:`GPT`: GPT-2 small at 1,024 tokens (nanoGPT's layout: learned positions, 12 causal
  blocks with ``F.scaled_dot_product_attention(is_causal=True)``, the LM head tied to the
  token embedding, two AdamW param groups: decay on matrices only).

``SIZES[name]["full"|"tiny"]`` are the keyword arguments; ``model_flops`` counts one training
step's FLOPs analytically (6 x matmul params x tokens + 12 x layers x d x T per token for
attention: the PaLM appendix's count, causal attention counted whole as there).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

SIZES: dict[str, dict[str, dict[str, int]]] = {
    "whisper": {
        "full": {"d": 512, "layers": 6, "heads": 8, "mlp": 2048, "frames": 1500, "mels": 80},
        "tiny": {"d": 32, "layers": 2, "heads": 2, "mlp": 64, "frames": 16, "mels": 8},
    },
    "vit": {
        "full": {"d": 768, "layers": 12, "heads": 12, "mlp": 3072, "image": 224, "patch": 16},
        "tiny": {"d": 32, "layers": 2, "heads": 2, "mlp": 64, "image": 32, "patch": 8},
    },
    "gpt": {
        "full": {"d": 768, "layers": 12, "heads": 12, "vocab": 50304, "context": 1024},
        "tiny": {"d": 32, "layers": 2, "heads": 2, "vocab": 128, "context": 16},
    },
}
BATCH = {"whisper": 16, "vit": 64, "gpt": 8}
CLASSES = {"whisper": 10, "vit": 1000}
LR = 3e-4


class WhisperEncoderClassifier(L.LightningModule):
    """Whisper-base's encoder over log-mel frames ``[B, mels, 2 x frames]``, mean-pooled."""

    def __init__(
        self, d: int, layers: int, heads: int, mlp: int, frames: int, mels: int, classes: int = 10
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv1d(mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.randn(frames, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, mlp, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv2(F.gelu(self.conv1(mel))))  # [B, d, frames]
        h = h.transpose(1, 2) + self.pos
        return self.head(self.ln(self.encoder(h)).mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        mel, label = batch
        loss = F.cross_entropy(self(mel), label)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)


class Block(nn.Module):
    """A pre-norm transformer block with fused-attention-ready ``scaled_dot_product_attention``."""

    def __init__(self, d: int, heads: int, mlp: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp)
        self.fc2 = nn.Linear(mlp, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViTClassifier(L.LightningModule):
    """ViT-B/16-style image classifier over ``[B, 3, image, image]``."""

    def __init__(
        self, d: int, layers: int, heads: int, mlp: int, image: int, patch: int, classes: int = 1000
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.patch = nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, mlp) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)  # [B, patches, d]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        image, label = batch
        loss = F.cross_entropy(self(image), label, label_smoothing=0.1)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.05)


class GPT(L.LightningModule):
    """GPT-2-small-style decoder over ``[B, context]`` tokens, next-token loss."""

    def __init__(self, d: int, layers: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, 4 * d, causal=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as GPT-2 (and nanoGPT) do

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def make_module(name: str, size: dict[str, int]) -> L.LightningModule:
    """A fresh module of model ``name`` ("whisper", "vit", "gpt") at ``size``."""
    torch.manual_seed(0)
    if name == "whisper":
        return WhisperEncoderClassifier(**size, classes=CLASSES["whisper"])
    if name == "vit":
        return ViTClassifier(**size, classes=CLASSES["vit"])
    if name == "gpt":
        return GPT(**size)
    raise ValueError(f"model {name!r}: expected one of {sorted(SIZES)}")


def make_loader(name: str, size: dict[str, int], batch: int, steps: int) -> DataLoader[Any]:
    """Synthetic data: a pool of 4 batches, sampled (shuffled) for ``steps`` batches."""
    g = torch.Generator().manual_seed(0)
    n = 4 * batch
    if name == "whisper":
        x = torch.randn(n, size["mels"], 2 * size["frames"], generator=g)
        y = torch.randint(0, CLASSES["whisper"], (n,), generator=g)
    elif name == "vit":
        x = torch.randn(n, 3, size["image"], size["image"], generator=g)
        y = torch.randint(0, CLASSES["vit"], (n,), generator=g)
    else:
        tokens = torch.randint(0, size["vocab"], (n, size["context"] + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sampler = RandomSampler(range(n), num_samples=batch * steps, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, sampler=sampler, drop_last=True)


def tokens_per_sample(name: str, size: dict[str, int]) -> int:
    """The sequence length the transformer runs at."""
    if name == "whisper":
        return size["frames"]
    if name == "vit":
        return (size["image"] // size["patch"]) ** 2 + 1
    return size["context"]


def model_flops(name: str, size: dict[str, int], batch: int) -> float:
    """FLOPs of one training step: 6 x matmul params x positions + attention (12 L d T^2 B).

    Matmul params are the Linear and Conv weights (each conv weight counted once per output
    position) and the tied LM head; embeddings, norms and biases are left out.

    Example:
        >>> f"{model_flops('gpt', SIZES['gpt']['full'], 8) / 1e12:.1f}"
        '7.0'
    """
    d, layers, t = size["d"], size["layers"], tokens_per_sample(name, size)
    mlp = size.get("mlp", 4 * d)
    per_layer = 4 * d * d + 2 * d * mlp  # qkv + out projection + MLP
    flops = 6.0 * batch * t * layers * per_layer + 12.0 * layers * d * t * t * batch
    if name == "whisper":
        stem = 2 * size["frames"] * size["mels"] * 3 * d + size["frames"] * d * 3 * d
        flops += 6.0 * batch * stem + 6.0 * batch * d * CLASSES["whisper"]
    elif name == "vit":
        flops += 6.0 * batch * (t - 1) * 3 * size["patch"] ** 2 * d
        flops += 6.0 * batch * d * CLASSES["vit"]
    else:
        flops += 6.0 * batch * t * d * size["vocab"]
    return flops


def param_count(module: nn.Module) -> int:
    """Parameters, each tied tensor counted once."""
    return sum(p.numel() for p in module.parameters())


__all__ = [
    "BATCH",
    "GPT",
    "SIZES",
    "ViTClassifier",
    "WhisperEncoderClassifier",
    "make_loader",
    "make_module",
    "model_flops",
    "param_count",
    "tokens_per_sample",
]
