"""The two benchmark recipes: the same model, data and batch size for every peer.

- ``mlp``: the digits MLP (64-256-256-10) on scikit-learn's digits through the recipe's own
  ``DigitsDataModule``; overhead-dominated (a step is tens of microseconds of math).
- ``encoder``: the spoken-digits encoder (Conv1d stem + 2 transformer blocks, width 64) on
  synthetic log-mel batches of the recipe's shapes (``features[B, 64, 40]``, ``frame_mask``,
  ``y``) from an in-memory Dataset and a torch DataLoader; compute-dominated. Synthesising
  the eSpeak set and its torchaudio features would measure the data pipeline, not the shell.

Dropout is 0 in every path (the hand-written peers then need no dropout keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from flax import linen as fnn
from torch.utils.data import DataLoader, Dataset

BATCH = 64
FRAMES, MELS = 64, 40


class SyntheticFeatures(Dataset[dict[str, torch.Tensor]]):
    """Log-mel-like rows ``{"features": float32[T, M], "frame_mask": bool[T], "y": int32}``.

    Each clip has a valid length between ``T/2`` and ``T`` frames (the rest masked), as the
    spoken-digits collate produces for one length bucket.
    """

    def __init__(self, rows: int = 1024, frames: int = FRAMES, mels: int = MELS) -> None:
        g = torch.Generator().manual_seed(0)
        self.features = torch.randn(rows, frames, mels, generator=g)
        lengths = torch.randint(frames // 2, frames + 1, (rows,), generator=g)
        self.frame_mask = torch.arange(frames)[None, :] < lengths[:, None]
        self.y = torch.randint(0, 10, (rows,), generator=g, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[i], "frame_mask": self.frame_mask[i], "y": self.y[i]}


class SyntheticFeaturesDataModule(L.LightningDataModule):
    """Shuffled, ``drop_last`` training batches of :class:`SyntheticFeatures`."""

    def __init__(self, batch_size: int = BATCH, rows: int = 1024) -> None:
        super().__init__()
        self.batch_size, self.rows = batch_size, rows

    def setup(self, stage: str | None = None) -> None:
        self.dataset = SyntheticFeatures(self.rows)

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(0),
        )


@dataclass(frozen=True)
class Recipe:
    """One model and its data, in every framework the peers need."""

    name: str
    inputs: tuple[str, ...]
    flax: Callable[[], fnn.Module]
    twin: Callable[[], torch.nn.Module]
    keras: Callable[[], Any]
    datamodule: Callable[[int], L.LightningDataModule]


def _digits_dm(batch_size: int) -> L.LightningDataModule:
    from torchshell.data.digits import DigitsDataModule

    return DigitsDataModule(batch_size=batch_size)


def _mlp() -> Recipe:
    from benchmarks._keras_peer import keras_mlp
    from jaxcore.models.digits import MLP
    from torchshell.twins.digits import MLP as TwinMLP

    return Recipe(
        name="digits MLP",
        inputs=("x",),
        flax=lambda: MLP(features=(256, 256)),
        twin=lambda: TwinMLP(64, (256, 256)),
        keras=keras_mlp,
        datamodule=_digits_dm,
    )


def _encoder() -> Recipe:
    from benchmarks._keras_peer import keras_encoder
    from jaxcore.models.spoken_digits import SpokenDigitsEncoder
    from torchshell.twins.spoken_digits import SpokenDigitsEncoder as Twin

    return Recipe(
        name="spoken-digits encoder",
        inputs=("features", "frame_mask"),
        flax=lambda: SpokenDigitsEncoder(width=64, depth=2, heads=4, dropout=0.0),
        twin=lambda: Twin(n_mels=MELS, width=64, depth=2, heads=4, dropout=0.0),
        keras=lambda: keras_encoder(FRAMES, MELS),
        datamodule=lambda bs: SyntheticFeaturesDataModule(batch_size=bs),
    )


RECIPES: dict[str, Callable[[], Recipe]] = {"mlp": _mlp, "encoder": _encoder}


def materialize(dm: L.LightningDataModule) -> list[dict[str, np.ndarray]]:
    """One epoch of the training loader's batches, as numpy arrays (for the on-device peer)."""
    dm.setup("fit")
    return [{k: v.numpy().copy() for k, v in b.items()} for b in dm.train_dataloader()]
