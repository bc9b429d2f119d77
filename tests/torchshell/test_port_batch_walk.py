"""``JaxModule.from_lightning``'s steady training batch (issue #53): what the port does per
batch is matching against the run's first batch, not preparing it again.

- the calls into ``torchshell/port/`` per steady batch stay few (counted as
  ``tests/calls.py`` counts them; 33 before the per-batch work was cut, 14 after);
- a batch ``prepare`` matched is placed and counted exactly as the full path does it;
- the value checks (a negative length, a misfit mask) still run on every matched batch.
"""

from __future__ import annotations

from typing import Any

import jax
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from jaxcore import BatchError
from tests.calls import CallCounter
from torchshell import JaxModule


class _Lit(L.LightningModule):
    """Reads ``x`` and ``y`` of a dict batch or of an ``(x, y)`` tuple; logs on step and on
    epoch (both of the port's per-batch log paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        self.log("train/epoch_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Named(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def _trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_a_steady_batch_makes_few_calls_into_the_port() -> None:
    counter = CallCounter(start=8)
    module = JaxModule.from_lightning(_Lit())
    module.print_summary = False
    _trainer(max_epochs=1, callbacks=[counter]).fit(module, DataLoader(_Named(24 * 8), 8))
    port = {k: n for k, n in counter.table() if k.startswith("torchshell/port/")}
    assert len(counter.counts) >= 12, "the counter saw too few batches"
    # (each adapter call the module makes is one call: the hooks' run x2, counted,
    # before_step, prepare, one_step_view, outputs_ahead, step_for, checked, after_step with
    # its specs, logging_step, wants_outputs, align_logger_step)
    assert sum(port.values()) <= 14, port


def _batches() -> list[Any]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return [
        (x, y),
        (x + 1, y),  # the same form: matched
        (x[:5], y[:5]),  # rows the 8 devices do not divide: whole on every device
        (x[:5], y[:4]),  # the fields' rows differ: the first field's counted
        (x + 2, y),  # the steady form again: its hand-over as planned on the second
        {"x": x, "y": y},  # another container: the full path, learned anew
        {"x": x[:8], "y": y[:8]},  # matched
        {"x": x[:8] * 2, "y": y[:8]},
    ]


def test_a_matched_batch_is_placed_and_counted_as_the_full_path_does() -> None:
    adapter = JaxModule.from_lightning(_Lit()).adapter
    for batch in _batches():
        prepared = adapter.prepare(batch)
        assert prepared is batch  # (tensors only: nothing set aside)
        placed, one, rows = adapter.one_step_view(prepared, 1)
        assert one is batch
        assert rows == adapter.global_rows(batch)  # (the full path's: nothing kept now)
        full = adapter.to_jax(batch)
        assert type(placed) is type(batch)
        got = [(a.sharding, a.shape, a.dtype) for a in jax.tree.leaves(placed)]
        assert got == [(a.sharding, a.shape, a.dtype) for a in jax.tree.leaves(full)]
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(full), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_matched_batch_still_has_its_lengths_and_masks_checked() -> None:
    adapter = JaxModule.from_lightning(_Lit()).adapter
    x, y = torch.ones(4, 6), torch.zeros(4, dtype=torch.long)
    good = {"x": x, "y": y, "lengths": torch.tensor([6, 2, 3, 1])}
    for _ in range(2):  # (the first learns the form; the second is matched)
        assert adapter.prepare(dict(good)) is not None
    with pytest.raises(BatchError, match="'lengths' holds -1 at row 2"):
        adapter.prepare({**good, "lengths": torch.tensor([6, 2, -1, 1])})
    with pytest.raises(BatchError, match="mask"):
        adapter.prepare({**good, "mask": torch.ones(3, 6)})  # (other keys: the full path)
    adapter.prepare({**good, "mask": torch.ones(4, 6)})  # learned with its mask
    with pytest.raises(BatchError, match="mask"):
        adapter.prepare({**good, "mask": torch.ones(3, 6)})  # matched: checked too
