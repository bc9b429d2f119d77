"""Lightning's loader arrangements and logging reductions through ``from_lightning``, each
against plain Lightning: several validation/test/predict loaders (``dataloader_idx``), a dict
of training loaders, ``self.log(reduce_fx=...)``, accumulated batches whose ``mask``
counts differ, values logged as ``.item()``/numpy numbers, and step outputs appended to lists
for an epoch-end hook."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.helpers import assert_fit_like_plain, fit_plain_and_ported, quiet_trainer
from torchshell import JaxModule
from torchshell._errors import ConfigError

_G = torch.Generator().manual_seed(0)
X = torch.randn(100, 8, generator=_G)
Y = (X[:, 0] > 0).long()


def _loader(n: int = 100, batch_size: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(X[:n], Y[:n]), batch_size=batch_size)


class Classifier(L.LightningModule):
    """A small MLP; ``training_step`` logs ``train_loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SeveralLoaders(Classifier):
    """Evaluation hooks that take ``dataloader_idx``, as Lightning asks with several loaders."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        self.log(f"val_acc_{dataloader_idx}", (self(x).argmax(1) == y).float().mean())

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(f"test_loss_{dataloader_idx}", loss, add_dataloader_idx=False)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]) + dataloader_idx


class TwoTrainLoaders(Classifier):
    """``training_step`` reads a dict of two loaders' batches (of 32 and 16 rows)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x1, y1), (x2, y2) = batch["a"], batch["b"]
        loss = F.cross_entropy(self(x1), y1) + 0.5 * F.cross_entropy(self(x2), y2)
        self.log("train_loss", loss, on_epoch=True)
        return loss


class Reductions(Classifier):
    """One loss logged per epoch under each of Lightning's reductions."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"loss_{fx}", loss, on_step=False, on_epoch=True, reduce_fx=fx)
        return loss


def _trainer(tmp_path: Path, **flags: Any) -> L.Trainer:
    return quiet_trainer(default_root_dir=tmp_path, **(flags or {"max_epochs": 2}))


def _metrics(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_several_evaluation_loaders_log_and_predict_per_loader_as_plain_lightning(
    tmp_path: Path,
) -> None:
    vals = [_loader(50), _loader(100, 16)]
    runs = fit_plain_and_ported(SeveralLoaders, tmp_path, _loader(), vals)
    _close(_metrics(runs["plain"][0]), _metrics(runs["jax"][0]))
    assert "val_loss/dataloader_idx_1" in runs["jax"][0].callback_metrics
    tests = [_loader(40), _loader(60, 20)]
    plain_test = runs["plain"][0].test(runs["plain"][1], tests, verbose=False)
    jax_test = runs["jax"][0].test(runs["jax"][1], tests, verbose=False)
    assert len(jax_test) == 2
    for a, b in zip(plain_test, jax_test, strict=True):
        _close(a, b)
    assert list(jax_test[0]) == ["test_loss_0"] and list(jax_test[1]) == ["test_loss_1"]
    preds = [DataLoader(TensorDataset(X[:10]), batch_size=5)] * 2
    plain_pred = runs["plain"][0].predict(runs["plain"][1], preds)
    jax_pred = runs["jax"][0].predict(runs["jax"][1], preds)
    for a, b in zip(plain_pred, jax_pred, strict=True):  # a list per loader
        torch.testing.assert_close(torch.cat(a), torch.cat(b), rtol=1e-4, atol=1e-5)


def test_several_loaders_need_dataloader_idx_in_the_users_hook(tmp_path: Path) -> None:
    class NoIndex(Classifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    module = JaxModule.from_lightning(NoIndex(), print_summary=False)
    with pytest.raises(ConfigError, match=r"NoIndex\.validation_step.*dataloader_idx=0"):
        _trainer(tmp_path).fit(module, _loader(), [_loader(50), _loader(60)])


def test_a_dict_of_training_loaders_trains_as_plain_lightning(tmp_path: Path) -> None:
    runs = fit_plain_and_ported(TwoTrainLoaders, tmp_path, {"a": _loader(), "b": _loader(64, 16)})
    _close(_metrics(runs["plain"][0]), _metrics(runs["jax"][0]))
    plain, ported = runs["plain"][1].state_dict(), runs["jax"][1].torch_state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(ported[name], value, rtol=1e-4, atol=1e-5)


def test_logged_reductions_sum_max_min_mean_as_plain_lightning(tmp_path: Path) -> None:
    """100 rows in batches of 32: Lightning sums the logged values unweighted (before: each
    was weighted by its batch's rows, a sum ~25x too large)."""
    runs = fit_plain_and_ported(Reductions, tmp_path, _loader())
    plain, ported = _metrics(runs["plain"][0]), _metrics(runs["jax"][0])
    _close(plain, ported)
    assert ported["loss_sum"] > 3 * ported["loss_mean"]  # four batches, summed


class Masked(Dataset):
    """Sequences with a padding ``mask`` whose valid counts differ from batch to batch."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 6, 4, generator=g)
        lengths = torch.randint(1, 7, (64,), generator=g)
        self.mask = torch.arange(6)[None, :] < lengths[:, None]
        self.y = torch.randn(64, generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "mask": self.mask[i], "y": self.y[i]}


class MaskedRegressor(L.LightningModule):
    """A masked mean over time, regressed on ``y``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        m = batch["mask"].float()
        pred = (self.lin(batch["x"]).squeeze(-1) * m).sum(1) / m.sum(1)
        loss = F.mse_loss(pred, batch["y"])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_accumulated_batches_weigh_equally_whatever_their_mask(tmp_path: Path) -> None:
    """Lightning adds ``loss / accumulate_grad_batches`` per batch. Before, a user's ``mask``
    field weighed each batch by its valid tokens (weights 0.037 apart after one epoch)."""
    loader = DataLoader(Masked(), batch_size=8)
    runs = fit_plain_and_ported(
        MaskedRegressor, tmp_path, loader, max_epochs=1, accumulate_grad_batches=2
    )
    plain, ported = runs["plain"][1].state_dict(), runs["jax"][1].torch_state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(ported[name], value, rtol=1e-5, atol=1e-6)


class ItemLogs(Classifier):
    """Values logged as Python numbers: ``tensor.item()`` (and arithmetic on it), numpy."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out, y)
        self.log("acc", (out.argmax(1) == y).sum().item() / len(y))
        self.log("loss_item", loss.item(), prog_bar=True)
        self.log("half", np.float32(0.5))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", 1.0 - (self(x).argmax(1) != y).float().mean().item())


def test_item_and_numpy_values_log_as_plain_lightning(tmp_path: Path) -> None:
    """Before: ``self.log("acc", t.item())`` in a traced step was refused ("got a
    TracedScalar"), a numpy scalar too."""
    runs = fit_plain_and_ported(ItemLogs, tmp_path, _loader(), _loader(50))
    _close(_metrics(runs["plain"][0]), _metrics(runs["jax"][0]))


class StepOutputs(Classifier):
    """Lightning 2's pattern for epoch-end aggregation: steps append to lists on ``self``."""

    def __init__(self, in_training: bool = False) -> None:
        super().__init__()
        self.in_training = in_training
        self.training_step_outputs: list[torch.Tensor] = []
        self.validation_step_outputs: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.in_training:
            self.training_step_outputs.append(loss.detach())
            self.log("loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
            self.log("loss_mean", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        correct = (out.argmax(1) == y).sum()
        self.validation_step_outputs.append({"loss": F.cross_entropy(out, y), "n": correct})

    def on_train_epoch_end(self) -> None:
        if self.in_training:
            outs = self.training_step_outputs
            self.log("train_mean", torch.stack(outs).mean())
            self.log("train_batches", float(len(outs)))
            outs.clear()

    def on_validation_epoch_end(self) -> None:
        outs = self.validation_step_outputs
        self.log("val_mean", torch.stack([o["loss"] for o in outs]).mean())
        self.log("val_correct", sum(o["n"] for o in outs).float())
        self.log("val_batches", float(len(outs)))
        outs.clear()


def test_validation_outputs_appended_to_a_list_reach_the_epoch_end_hook(tmp_path: Path) -> None:
    """Before: the traced step appended torchax tensors that failed in the epoch-end hook
    ("torchax Tensors can only do math within the torchax environment"). Now each batch's
    values are appended on the host, as in plain Lightning."""
    runs = fit_plain_and_ported(StepOutputs, tmp_path, _loader(), _loader(100, 25))
    _close(_metrics(runs["plain"][0]), _metrics(runs["jax"][0]))
    assert runs["jax"][0].callback_metrics["val_batches"] == 4
    assert runs["jax"][1].adapter.port.module.validation_step_outputs == []


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_outputs_appended_to_a_list_reach_the_epoch_end_hook(
    tmp_path: Path, accumulate: int
) -> None:
    """Before: refused ("a compiled training step runs on the device"). Lightning 2's
    migration guide writes epoch-end aggregation this way, so a module that does must run
    unchanged: each batch's value, equal to plain Lightning's, is in the list at epoch end
    (under accumulation too: a micro-batch's own loss, before its window's step)."""
    runs = fit_plain_and_ported(
        lambda: StepOutputs(in_training=True),
        tmp_path,
        _loader(100, 25),
        _loader(100, 50),
        accumulate_grad_batches=accumulate,
        max_epochs=2,
    )
    # every logged value as plain Lightning's (also the on-step train_loss under
    # accumulation: the last batch's own, was the window's mean)
    _close(_metrics(runs["plain"][0]), _metrics(runs["jax"][0]))
    assert runs["jax"][0].callback_metrics["train_batches"] == 4


class LossSeen(L.Callback):
    """A team's callback reading ``outputs["loss"]`` (and ``"preds"``, when the step returns
    them) in ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.preds: list[list[int]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        if "preds" in outputs:
            self.preds.append(outputs["preds"].tolist())


class ReturnsPreds(Classifier):
    """``training_step`` returns a dict with the batch's predictions beside the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        out = self(x)
        return {"loss": F.cross_entropy(out, y), "preds": out.argmax(1)}


@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_callback_gets_each_batchs_outputs_as_plain_lightning(
    tmp_path: Path, accumulate: int
) -> None:
    """Before: the extra keys a training_step returns (``preds``) never reached
    ``on_train_batch_end``, and under ``accumulate_grad_batches`` the first window's batches
    had no ``outputs["loss"]`` (a KeyError) and later ones the previous window's. Now each
    batch's own: its loss / accumulate_grad_batches and its predictions, as Lightning gives.

    With 4: an epoch's windows are 4 x 16 rows, then 16, 16 and 4 (short and ragged: was
    refused, "the batches of one window differ in shape"); the second epoch's values show the
    weights those windows made equal plain Lightning's."""
    seen = {}
    for mode in ("plain", "jax"):
        callback = LossSeen()
        user = ReturnsPreds()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = _trainer(
            tmp_path / mode, max_epochs=2, accumulate_grad_batches=accumulate, callbacks=[callback]
        )
        trainer.fit(module, _loader(100, 16))  # 7 batches an epoch: a short last window
        seen[mode] = callback
    assert len(seen["jax"].losses) == 14
    assert seen["jax"].losses == pytest.approx(seen["plain"].losses, rel=1e-5)
    assert seen["jax"].preds == seen["plain"].preds
    if accumulate == 1:  # extras no callback reads cost nothing (no second forward pass)
        module = JaxModule.from_lightning(ReturnsPreds(), print_summary=False)
        _trainer(tmp_path / "unread", max_steps=2).fit(module, _loader(100, 16))
        assert module.compiled.forward is None and module.state is not None


def test_a_user_callback_reads_each_steps_loss_from_outputs(tmp_path: Path) -> None:
    """Before: every JaxModule returned nothing from training_step, so a callback's
    ``outputs["loss"]`` was a KeyError. Now, with such a callback (and only then: it waits for
    each step), the loss of each step, equal to plain Lightning's; K=1 (no windows)."""
    seen = {}
    for mode in ("plain", "jax"):
        callback = LossSeen()
        user = Classifier()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = _trainer(tmp_path / mode, max_steps=4)
        trainer.callbacks.append(callback)
        trainer.fit(module, _loader())
        seen[mode] = callback.losses
    assert seen["jax"] == pytest.approx(seen["plain"], rel=1e-5) and len(seen["jax"]) == 4

    import jaxcore
    from jaxcore.models.digits import MLP

    flax = JaxModule(MLP(features=(8,)), jaxcore.softmax_cross_entropy, jaxcore.make_optimizer())
    callback = LossSeen()
    trainer = _trainer(tmp_path / "flax", max_steps=30, callbacks=[callback])
    x = torch.randn(64 * 30, 64, generator=torch.Generator().manual_seed(0))
    trainer.fit(flax, DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), 64))
    assert len(callback.losses) == 30 and flax.window_k == 1  # every step's own loss, no window
    assert callback.losses[-1] < callback.losses[0]

    # accumulated: each batch's own loss / 2 (the window's step runs at its second batch)
    callback = LossSeen()
    trainer = _trainer(
        tmp_path / "acc", max_steps=15, callbacks=[callback], accumulate_grad_batches=2
    )
    trainer.fit(flax, DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), 64))
    assert len(callback.losses) == 30
    window = float(flax._last_metrics["loss"])  # the last window's mean loss
    assert callback.losses[-2] + callback.losses[-1] == pytest.approx(window, rel=1e-5)
    assert callback.losses[-1] != callback.losses[-2]


class LogsItsBatchSize(L.LightningModule):
    """``self.log(..., batch_size=len(y))``, as modules with dict or nested batches write it:
    Lightning weights the epoch means by it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), batch_size=len(y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_epoch_means_weigh_each_batch_by_its_own_logged_batch_size(
    tmp_path: Path, accumulate: int
) -> None:
    """Before: the ``batch_size=`` of the last compiled shape weighed every batch (after the
    ragged last batch compiled, all batches weighed 8 rows), so ``val_loss`` and
    ``train_loss_epoch`` were plain means of the batch values. Now each batch's own size
    travels with its values: every ``callback_metrics`` value equals plain Lightning's."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    loaders = DataLoader(data, batch_size=16), DataLoader(data, batch_size=16)
    runs = fit_plain_and_ported(
        LogsItsBatchSize, tmp_path, *loaders, max_epochs=2, accumulate_grad_batches=accumulate
    )
    assert {"val_loss", "train_loss_epoch"} <= set(runs["plain"][0].callback_metrics)
    assert_fit_like_plain(runs, rtol=1e-5, atol=1e-6)
