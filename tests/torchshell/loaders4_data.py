"""Datasets, samplers and collates for ``test_user_loaders4.py``, in a module of their own so
that spawned DataLoader workers can unpickle them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset, IterableDataset, Sampler

_g = torch.Generator().manual_seed(0)
X = torch.randn(37, 20, generator=_g)  # 37 rows: batches of 8 and a ragged last one of 5
Y = torch.randint(0, 3, (37,), generator=_g)


class Stream(IterableDataset):
    """Rows streamed one by one (no ``__len__``), as a team reads shards or a queue."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from zip(X, Y, strict=True)


class Records(Dataset):
    """A pandas-style Dataset: a dict of a numpy float64 array, a Python float and an int
    (``default_collate``: float64 and int64 tensors)."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": X[i].numpy().astype(np.float64), "w": float(i % 3) / 2, "y": int(Y[i])}


class Rows(Dataset):
    """``(tensor, int)`` items: ``default_collate`` makes ``[x, y]``, y int64."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return X[i], int(Y[i])


class Sentences(Dataset):
    """Token sequences of 2 to 9 ids with a label (the parity of their first token)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        n = 2 + (i * 7) % 8
        ids = torch.randint(1, 30, (n,), generator=g)
        return ids, int(ids[0]) % 2


def pad_collate(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """``pad_sequence`` plus the true ``lengths``, as torch's NLP tutorials collate."""
    seqs = [s for s, _ in items]
    return {
        "ids": pad_sequence(seqs, batch_first=True),
        "lengths": torch.tensor([len(s) for s in seqs]),
        "y": torch.tensor([label for _, label in items]),
    }


class Buckets(Sampler[list[int]]):
    """A bucketing ``batch_sampler``: rows of similar length together, so the padded length
    ``T`` differs from batch to batch."""

    def __init__(self, data: Sentences, batch_size: int) -> None:
        self.lengths = [len(data[i][0]) for i in range(len(data))]
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        for start in range(0, len(order), self.batch_size):
            yield order[start : start + self.batch_size]

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)


class Numbered(Dataset):
    """``(x, y, index)`` items: a collate can change the batch's form by its position."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return X[i], Y[i], i
