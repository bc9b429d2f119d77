"""What training logs and what the evaluation hooks run are the adapter's method groups
(``adapter.logs``, ``adapter.evaluation``), called by ``JaxModule``'s own hooks: the Flax path
through the defaults, a ported ``LightningModule`` through ``LightningLogs`` and
``LightningEvaluation``: a plain ``JaxModule`` inherits neither."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from jaxcore.models.digits import MLP
from tests.helpers import quiet_trainer
from tests.torchshell.lit_digits import LitDigits
from torchshell import JaxModule
from torchshell.adapters._eval import EvalHooks
from torchshell.adapters._logs import TrainLogs
from torchshell.data.digits import DigitsDataModule


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _flax() -> JaxModule:
    return JaxModule(
        MLP(features=(16,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        steps_per_call=1,
        print_summary=False,
    )


class _Renamed(TrainLogs):
    """Logs the loss function's metrics (and the step's own learning rate, refused steps) as
    ``mine/<name>``; counts the epoch ends."""

    own_train = "mine/"

    def __init__(self) -> None:
        self.epoch_ends = 0

    def train_values(self, module: Any, metrics: dict[str, Any]) -> dict[str, Any]:
        return {f"mine/{k}": v for k, v in metrics.items()}

    def train_epoch_end(self, module: Any) -> None:
        self.epoch_ends += 1


class _Doubled(EvalHooks):
    """Predictions twice the model's outputs."""

    def predict_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> Any:
        return 2 * super().predict_step(module, batch, batch_idx, dataloader_idx)


def test_a_flax_module_logs_and_predicts_through_its_adapters_groups() -> None:
    module = _flax()
    assert type(module.adapter.logs) is TrainLogs
    assert type(module.adapter.evaluation) is EvalHooks
    module.adapter.logs = logs = _Renamed()
    trainer = quiet_trainer(max_epochs=2, log_every_n_steps=1)
    trainer.fit(module, _loader())
    names = set(trainer.callback_metrics)
    assert {"mine/loss", "mine/accuracy", "mine/lr", "mine/nonfinite_steps"} <= names, names
    assert not {n for n in names if n.startswith("train/")}, names
    assert logs.epoch_ends == 2
    plain = torch.cat(trainer.predict(module, _loader()))
    module.adapter.evaluation = _Doubled()
    doubled = torch.cat(trainer.predict(module, _loader()))
    torch.testing.assert_close(doubled, 2 * plain)


def test_a_ported_module_logs_and_evaluates_through_its_adapters_groups() -> None:
    from torchshell.port._user import LightningEvaluation, LightningLogs

    module = JaxModule.from_lightning(LitDigits(), print_summary=False)
    assert type(module) is JaxModule  # (groups the adapter owns, not mixins)
    assert isinstance(module.adapter.logs, LightningLogs)
    assert isinstance(module.adapter.evaluation, LightningEvaluation)
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=2)
    trainer.fit(module, DigitsDataModule(batch_size=32))
    assert {"train_loss", "val_acc"} <= set(trainer.callback_metrics)
    assert module.adapter.evaluation.steps  # (the compiled validation step: the group's)
