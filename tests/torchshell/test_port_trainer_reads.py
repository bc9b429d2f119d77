"""Trainer values read by an automatic-optimization ``training_step``, as plain Lightning has
them: ``current_epoch`` and ``is_last_batch`` change the loss, and the compiled step follows
(one program per value set: :mod:`torchshell.port._host_reads`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.torchshell.port_helpers import net
from tests.torchshell.test_port_manual_docs import _data, _fit_both


class EpochWeighted(L.LightningModule):
    """A loss weighted by the epoch (a warm-up) and by the epoch's last batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.current_epoch >= 1:
            loss = loss * 3.0
        if self.trainer.is_last_batch:
            loss = loss * 0.5
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_epoch_and_last_batch_reads_follow_the_trainer(tmp_path: Path) -> None:
    _, _, t_ported = _fit_both(
        EpochWeighted, lambda: _data(3), ("train_loss",), tmp_path, max_epochs=3
    )
    assert t_ported.global_step == 9
    # one program per value set read, the earlier epochs' dropped (port/_host_reads.reusable):
    # the last epoch's two (last batch or not) are held
    assert len(t_ported.lightning_module.adapter.steps.host_steps) == 2
