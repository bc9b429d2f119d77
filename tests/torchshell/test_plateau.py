"""``ReduceLROnPlateau`` in a LightningModule's ``configure_optimizers``, through
``JaxModule.from_lightning``: the same lr per epoch, weights and resumed runs as plain Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchshell import JaxModule
from torchshell._errors import ConfigError


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)


class Plateau(L.LightningModule):
    """Halves the lr whenever val_loss fails to *rise* (mode='max'): a reduction every epoch."""

    def __init__(self, monitor: str = "val_loss", interval: str = "epoch") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.monitor, self.interval = monitor, interval
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def on_train_epoch_start(self) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.4, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=1)
        schedule = {"scheduler": plateau, "monitor": self.monitor, "interval": self.interval}
        return {"optimizer": opt, "lr_scheduler": schedule}


def _fit(port: bool, tmp_path: Path, epochs: int, ckpt: str | None = None) -> Plateau:
    torch.manual_seed(0)
    user = Plateau()
    module = JaxModule.from_lightning(user, print_summary=False) if port else user
    trainer = L.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, _loader(), _loader(), ckpt_path=ckpt)
    return user


def test_plateau_reductions_and_weights_are_plain_lightnings(tmp_path: Path) -> None:
    plain = _fit(False, tmp_path / "plain", 6)
    ported = _fit(True, tmp_path / "port", 6)
    assert ported.lrs == plain.lrs
    assert plain.lrs[-1] < plain.lrs[0] / 3  # the scheduler did reduce, several times
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(ported.state_dict()[name], value, rtol=1e-4, atol=1e-6)


def test_a_resumed_plateau_run_continues_as_the_uninterrupted_one(tmp_path: Path) -> None:
    whole = _fit(True, tmp_path / "whole", 6)
    _fit(True, tmp_path / "cut", 3)
    last = str(tmp_path / "cut" / "last.ckpt")
    resumed = _fit(True, tmp_path / "resumed", 6, ckpt=last)
    assert resumed.lrs == whole.lrs[3:]
    # and the checkpoint is plain Lightning's: it resumes there too, at the same lr
    in_plain = _fit(False, tmp_path / "plain", 6, ckpt=last)
    assert in_plain.lrs == whole.lrs[3:]
    for name, value in whole.state_dict().items():
        np.testing.assert_allclose(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_plateau_on_a_missing_metric_or_per_step_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"monitors 'val_acc'.*Fix: log it"):
        user = Plateau(monitor="val_acc")
        L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False).fit(
            JaxModule.from_lightning(user, print_summary=False), _loader(), _loader()
        )
    with pytest.raises(ConfigError, match=r"interval='step'.*interval='epoch'"):
        L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False).fit(
            JaxModule.from_lightning(Plateau(interval="step"), print_summary=False), _loader()
        )
