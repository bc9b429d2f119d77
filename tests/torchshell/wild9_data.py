"""The datasets of round 9's modules (tests/torchshell/wild9_modules.py): survival rows,
tabular rows with missing values, per-task rows with a string (or id) task field, CLIP
pairs, waveforms, token rows and ratings, for test_port_wild9.py."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

# -- data -----------------------------------------------------------------------------------


def survival(n: int, seed: int) -> TensorDataset:
    """``(x[8], time > 0, event in {0., 1.})`` rows: hazard grows with ``x[:, 0]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    time = torch.rand(n, generator=g) * torch.exp(-x[:, 0]) + 0.01
    event = (torch.rand(n, generator=g) > 0.3).float()
    return TensorDataset(x, time, event)


def missing(n: int, seed: int) -> TensorDataset:
    """``(x[6] with ~20% NaN, y with ~10% NaN)`` rows, as a CSV with gaps reads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x[:, 0] - 0.5 * x[:, 1]
    x[torch.rand(n, 6, generator=g) < 0.2] = float("nan")
    y[torch.rand(n, generator=g) < 0.1] = float("nan")
    return TensorDataset(x, y)


class TaskRows(Dataset):
    """Rows ``{"x": [8], "y": int, "task": "sentiment" | "topic"}``; batches of 16 from
    :func:`task_batches` hold one task each (a per-task batch sampler)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.task = ["sentiment" if (i // 16) % 2 == 0 else "topic" for i in range(n)]
        self.y = [
            int(self.x[i, 0] > 0) if t == "sentiment" else int(self.x[i, 1:3].sum().abs() * 2) % 4
            for i, t in enumerate(self.task)
        ]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "task": self.task[i]}


def pairs(n: int, seed: int) -> TensorDataset:
    """CLIP's ``(image[12], text[6])`` pairs: the text a noisy projection of the image."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, 12, generator=g)
    txt = img[:, :6] + 0.3 * img[:, 6:] + 0.1 * torch.randn(n, 6, generator=g)
    return TensorDataset(img, txt)


def clips(n: int, seed: int) -> TensorDataset:
    """``(waveform[26], class in 0..2)``: a sine whose frequency is the class."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    t = torch.linspace(0, 1, 26)
    x = torch.sin(2 * math.pi * (y[:, None] + 1) * t) + 0.2 * torch.randn(n, 26, generator=g)
    return TensorDataset(x, y)


def tokens(n: int, seed: int) -> TensorDataset:
    """``[n, 9]`` token rows (ids 1..15; a padded tail of zeros on some rows)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 16, (n, 9), generator=g)
    ids[torch.arange(n) % 3 == 0, 6:] = 0
    return TensorDataset(ids)


def ratings(n: int, seed: int) -> TensorDataset:
    """``(user in 0..5, item in 0..7, rating)``: few users, so ids repeat in a batch."""
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, 6, (n,), generator=g), torch.randint(0, 8, (n,), generator=g)
    return TensorDataset(user, item, ((user % 3) - (item % 2)).float() + 0.1 * torch.randn(n))


TASKS = ("sentiment", "topic")


class TaskIdRows(TaskRows):
    """:class:`TaskRows` with the task as an id (coreshell's fix: tensors in the batch)."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = super().__getitem__(i)
        return {**row, "task": TASKS.index(row["task"])}
