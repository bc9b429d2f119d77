"""What a team's own batches and modules carry, through from_lightning and from_torch: its own
``mask`` field, strings next to the tensors, torchmetrics objects, and positional inputs of a
three-tensor ``TensorDataset`` (each against plain Lightning where both train)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torchmetrics
import torchmetrics.functional as tmf
from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from jaxcore import BatchError
from tests.helpers import assert_fit_like_plain, fit_plain_and_ported
from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell._errors import ConfigError


class Tokens(Dataset):
    """Token ids with a padding ``mask`` of the tokens ([T]) and a string id, as NLP data has."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        n = i % 6 + 1
        return {
            "tokens": torch.randint(0, 20, (6,), generator=g),
            "mask": (torch.arange(6) < n).float(),
            "label": i % 2,
            "id": f"utt-{i:03d}",
        }


class Bag(L.LightningModule):
    """A masked mean of embeddings; ``batch["id"]`` is there but not read by the step."""

    def __init__(self, read_id: bool = False) -> None:
        super().__init__()
        self.read_id = read_id
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.read_id:  # (its length is known while tracing; a value is not)
            assert batch["id"][0] != ""
        m = batch["mask"]
        h = (self.emb(batch["tokens"]) * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        loss = nn.functional.cross_entropy(self.head(h), batch["label"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(module: L.LightningModule, loader: DataLoader, tmp_path: Path, **limits: Any) -> Recorder:
    """Fits with a Recorder logging every step (``max_steps=6`` unless other limits given)."""
    logger = Recorder()
    trainer = L.Trainer(
        **(limits or {"max_steps": 6}),
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader)
    return logger


def test_a_lightning_batch_keeps_its_own_mask_and_string_fields(tmp_path: Path) -> None:
    loader = DataLoader(Tokens(), batch_size=8)
    torch.manual_seed(0)
    plain = _fit(Bag(), loader, tmp_path / "plain").series("train_loss")
    torch.manual_seed(0)
    ours = _fit(JaxModule.from_lightning(Bag(), print_summary=False), loader, tmp_path / "jax")
    assert len(ours.series("train_loss")) == len(plain) == 6
    np.testing.assert_allclose(ours.series("train_loss"), plain, rtol=1e-5)


def test_a_step_reading_a_string_field_is_told_which_field(tmp_path: Path) -> None:
    jm = JaxModule.from_lightning(Bag(read_id=True), print_summary=False)
    with pytest.raises(BatchError, match=r"\['id'\] holds a list, not a tensor.*on_train_batch"):
        _fit(jm, DataLoader(Tokens(), batch_size=8), tmp_path)


class WithMetric(L.LightningModule):
    """A metric whose state is a list of every prediction (AUROC): it cannot be compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.auroc = torchmetrics.classification.MulticlassAUROC(num_classes=3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.auroc(logits, y)
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_list_state_torchmetrics_metric_in_the_step_runs_on_the_host(tmp_path: Path) -> None:
    # (AUROC's state is a list of every prediction: the compiled step cannot hold it; the
    # host updates the user's metric from the step's tensors, as plain Lightning does)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    values = []
    for jax in (False, True):
        torch.manual_seed(0)
        user = WithMetric()
        _fit(
            JaxModule.from_lightning(user, print_summary=False) if jax else user,
            DataLoader(data, batch_size=8),
            tmp_path / str(jax),
        )
        assert "forward" not in vars(user.auroc)  # torchmetrics' own methods again
        assert len(user.auroc.preds) == 6  # one update per step
        values.append(float(user.auroc.compute()))
    assert values[1] == pytest.approx(values[0], rel=1e-5)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.float()[..., None]
        return self.head((self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=1))


def test_from_torch_positional_inputs_take_the_next_position_as_the_target(
    tmp_path: Path,
) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (32, 7), generator=g)
    mask = torch.ones(32, 7, dtype=torch.long)
    labels = torch.randint(0, 3, (32,), generator=g)
    loader = DataLoader(TensorDataset(ids, mask, labels), batch_size=8)
    torch.manual_seed(0)
    net = TwoInputs()
    ref = TwoInputs()
    ref.load_state_dict(net.state_dict())
    jm = JaxModule.from_torch(
        net,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(net.parameters(), lr=0.5),
        inputs=(0, 1),
        print_summary=False,
    )
    assert jm.batch_keys == ("x", "x1", "y")
    L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(jm, loader)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for a, b, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(ref(a, b), y).backward()
        opt.step()
    got = jm.torch_state_dict()
    for name, want in ref.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_a_flax_model_with_the_teams_own_mean_loss_trains_like_the_per_row_loss(
    tmp_path: Path,
) -> None:
    import optax

    import jaxcore
    from jaxcore.models.digits import MLP

    def mean_loss(logits: Any, batch: Any) -> Any:  # as a team writes it: a batch mean
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(70, 64, generator=g), torch.randint(0, 10, (70,), generator=g))
    losses = []
    for loss in (mean_loss, jaxcore.softmax_cross_entropy):
        jm = JaxModule(MLP(features=(16,)), loss, optax.sgd(0.1), print_summary=False)
        loader = DataLoader(data, batch_size=16)  # 70 rows: a padded last batch of 6
        losses.append(_fit(jm, loader, tmp_path, max_epochs=2).series("train/loss"))
    assert len(losses[0]) == 10
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def _rows() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 3))
        self.batch_size = 16

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_rows(), batch_size=self.batch_size)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _quiet_trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_the_users_module_holds_the_trained_weights_after_fit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    user, plain = Small(), Small()
    plain.load_state_dict(user.state_dict())
    weight = user.net[0].weight  # a reference the team holds stays the trained tensor
    before = {k: v.clone() for k, v in user.state_dict().items()}
    _quiet_trainer(tmp_path / "plain", max_epochs=1).fit(plain)
    jm = JaxModule.from_lightning(user, print_summary=False)
    _quiet_trainer(tmp_path / "jax", max_epochs=1).fit(jm)
    assert user.net[0].weight is weight
    after = user.state_dict()
    assert not torch.equal(after["net.0.weight"], before["net.0.weight"])
    for name, want in plain.state_dict().items():  # what plain Lightning leaves in the module
        np.testing.assert_allclose(after[name].numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


class Rows(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 16

    def train_dataloader(self) -> DataLoader:  # the batch size finder sets self.batch_size
        return DataLoader(_rows(), batch_size=self.batch_size)


def test_lightnings_batch_size_finder_runs_as_in_plain_lightning(tmp_path: Path) -> None:
    from lightning.pytorch.tuner import Tuner

    found = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        data = Rows()
        trainer = _quiet_trainer(tmp_path, max_epochs=1)
        found.append(Tuner(trainer).scale_batch_size(wrap(Small()), datamodule=data, max_trials=3))
        assert data.batch_size == found[-1]
    assert found[0] == found[1] == 8  # 2, 4, 8 (the finder saved and restored a checkpoint)
    # the module's own batch_size (its train_dataloader reads self.batch_size)
    user = Small()
    jm = JaxModule.from_lightning(user, print_summary=False)
    assert Tuner(_quiet_trainer(tmp_path, max_epochs=1)).scale_batch_size(jm, max_trials=3) == 8
    assert user.batch_size == jm.batch_size == 8


class DictOut(nn.Module):
    """Returns a mapping, as transformers models do (``ModelOutput(logits=...)``)."""

    def __init__(self, key: str = "logits") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.key = key

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.key: self.lin(x), "hidden": x}


def _own_logits_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits, y)  # as written for a ModelOutput


@pytest.mark.parametrize("loss", ["module", "own function"])
def test_a_torch_loss_on_a_model_output_with_logits_trains_like_torch(
    tmp_path: Path, loss: str
) -> None:
    torch.manual_seed(0)
    net, ref = DictOut(), DictOut()
    ref.load_state_dict(net.state_dict())
    loss_fn = nn.CrossEntropyLoss() if loss == "module" else _own_logits_loss
    jm = JaxModule.from_torch(
        net, loss_fn, torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    _quiet_trainer(tmp_path, max_steps=2).fit(jm, DataLoader(data, batch_size=8))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=8):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x)["logits"], y).backward()
        opt.step()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(jm.torch_state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_torch_loss_on_a_dict_without_logits_names_the_keys(tmp_path: Path) -> None:
    net = DictOut(key="scores")
    jm = JaxModule.from_torch(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    with pytest.raises(ConfigError, match=r"returned a dict with keys \['hidden', 'scores'\]"):
        _quiet_trainer(tmp_path, max_steps=1).fit(jm, DataLoader(data, batch_size=8))


class Pictures(Dataset):
    """uint8 images with an int label and the file name, as an image folder yields them."""

    def __init__(self, with_path: bool) -> None:
        self.with_path = with_path

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        item = {"x": torch.randint(0, 255, (4, 4, 1), dtype=torch.uint8, generator=g), "y": i % 3}
        if self.with_path:
            item["path"] = f"/pictures/{i}.png"
        return item


def test_a_flax_model_trains_on_batches_with_a_string_field(tmp_path: Path) -> None:
    import flax.linen as fnn
    import optax

    import jaxcore

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x: Any, train: bool = False) -> Any:
            return fnn.Dense(3)(x.reshape(x.shape[0], -1).astype("float32") / 255.0)

    losses = []
    for with_path in (True, False):
        jm = JaxModule(Net(), jaxcore.softmax_cross_entropy, optax.sgd(0.5), print_summary=False)
        loader = DataLoader(Pictures(with_path), batch_size=8)  # 20 rows: a padded last batch
        losses.append(_fit(jm, loader, tmp_path, max_epochs=1).series("train/loss"))
    assert len(losses[0]) == 3
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_lightnings_lr_finder_is_refused_rather_than_run_flat(tmp_path: Path) -> None:
    from lightning.pytorch.tuner import Tuner

    class WithLr(Small):
        def __init__(self, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()

    jm = JaxModule.from_lightning(WithLr(), print_summary=False)
    with pytest.raises(ConfigError, match=r"learning-rate finder.*plain LightningModule"):
        Tuner(_quiet_trainer(tmp_path, max_epochs=1)).lr_find(jm, num_training=5)


class ReadsProgress(L.LightningModule):
    """Scales its loss by the step, a curriculum a team may write inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        ramp = min(1.0, (self.global_step + 1) / 4)
        return ramp * nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_warned(jm: Any, tmp_path: Path, match: str, **limits: Any) -> list[Any]:
    """Fits ``jm`` on the rows; the warnings, one of which must match ``match``."""
    with pytest.warns(UserWarning, match=match) as seen:
        _quiet_trainer(tmp_path, **limits).fit(jm, DataLoader(_rows(), batch_size=16))
    return list(seen)


def test_reading_the_step_counter_in_a_traced_step_follows_the_trainer(tmp_path: Path) -> None:
    # self.global_step is a value the compiled step receives each call (test_port_reads.py
    # checks the values against plain Lightning): nothing is frozen, so nothing is warned
    jm = JaxModule.from_lightning(ReadsProgress(), print_summary=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_trainer(tmp_path, max_steps=3).fit(jm, DataLoader(_rows(), batch_size=16))
    assert not [w for w in seen if "global_step" in str(w.message)]
    assert type(jm.adapter.port.module) is ReadsProgress  # the class is the user's again


class WithHooks(Small):
    """Loop hooks as teams write them: counters, and values logged at the epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean())

    def on_fit_start(self) -> None:
        self.calls.append("fit_start")

    def on_train_epoch_start(self) -> None:
        self.calls.append("train_epoch_start")

    def on_train_epoch_end(self) -> None:
        self.calls.append("train_epoch_end")
        self.log("epochs_seen", float(self.calls.count("train_epoch_end")))

    def on_validation_epoch_end(self) -> None:
        self.calls.append("validation_epoch_end")
        self.log_dict({"val_marker": 1.5})

    def on_fit_end(self) -> None:
        self.calls.append("fit_end")


def test_the_users_loop_hooks_run_and_log_as_in_plain_lightning(tmp_path: Path) -> None:
    results = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        user = WithHooks()
        trainer = _quiet_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
        trainer.fit(wrap(user), DataLoader(_rows(), batch_size=16), DataLoader(_rows(), 16))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        results.append((user.calls, metrics["epochs_seen"], metrics["val_marker"]))
    assert results[1] == results[0]
    assert results[0][0][0] == "fit_start" and results[0][0][-1] == "fit_end"


class WithBatchHooks(Small):
    """Batch-level hooks as teams write them: a host-side transform, per-batch records."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.losses: list[float] = []
        self.sums: list[float] = []
        self.val_outputs: list[float] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x * 0.5, y  # the step sees only what this returns

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("after_transfer")
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls.append(f"train_start/{batch_idx}")
        self.sums.append(float(batch[0].abs().sum()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.log("seen", float(batch_idx))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.calls.append(f"val_end/{batch_idx}")
        self.val_outputs.append(float(outputs))


def test_the_users_batch_hooks_and_transforms_run_as_in_plain_lightning(tmp_path: Path) -> None:
    results = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        torch.manual_seed(0)
        user = WithBatchHooks()
        trainer = _quiet_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
        trainer.fit(wrap(user), DataLoader(_rows(), batch_size=16), DataLoader(_rows(), 32))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        results.append((user, metrics))
    (plain, plain_metrics), (ported, ported_metrics) = results
    assert ported.calls == plain.calls  # every hook, in the same order
    assert "train_start/3" in ported.calls and "val_end/1" in ported.calls
    np.testing.assert_allclose(ported.sums, plain.sums, rtol=1e-6)  # the transformed batch
    np.testing.assert_allclose(ported.losses, plain.losses, rtol=1e-5)  # outputs["loss"]
    np.testing.assert_allclose(ported.val_outputs, plain.val_outputs, rtol=1e-4)
    # 4 steps, fewer than log_every_n_steps: the last step's values still reach callback_metrics
    assert set(ported_metrics) == set(plain_metrics) == {"train_loss", "seen"}
    np.testing.assert_allclose(ported_metrics["train_loss"], plain_metrics["train_loss"], 1e-5)


class ZeroGradHook(Small):
    def on_before_zero_grad(self, optimizer: Any) -> None:
        pass


def test_a_zero_grad_hook_is_refused_not_skipped() -> None:
    with pytest.raises(ConfigError, match=r"on_before_zero_grad"):
        JaxModule.from_lightning(ZeroGradHook())


class WithFunctionalMetrics(Small):
    """Lightning's docs' pattern: ``torchmetrics.functional`` in the steps, logged per batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        preds = logits.argmax(-1)  # class indices: torchmetrics checks them with torch.unique
        self.log("train_acc", tmf.accuracy(preds, y, task="multiclass", num_classes=3))
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        preds = self.net(x).argmax(-1)
        self.log("val_acc", tmf.accuracy(preds, y, task="multiclass", num_classes=3))
        self.log("val_f1", tmf.f1_score(preds, y, task="multiclass", num_classes=3))


def test_functional_torchmetrics_in_the_steps_log_as_in_plain_lightning(tmp_path: Path) -> None:
    results = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        torch.manual_seed(0)
        trainer = _quiet_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
        trainer.fit(wrap(WithFunctionalMetrics()), DataLoader(_rows(), 16), DataLoader(_rows(), 16))
        results.append({k: float(v) for k, v in trainer.callback_metrics.items()})
    assert set(results[0]) == set(results[1]) == {"train_acc", "val_acc", "val_f1"}
    for name, value in results[0].items():
        assert results[1][name] == pytest.approx(value, abs=1e-5), name
    # and torchmetrics still checks its inputs outside the traced step
    with pytest.raises(RuntimeError, match=r"more unique values in `preds`"):
        tmf.accuracy(
            torch.tensor([0, 1, 2, 7]), torch.tensor([0, 1, 2, 0]), "multiclass", num_classes=3
        )


class WithMetricObjects(Small):
    """torchmetrics objects in validation_step, in the three ways Lightning's docs show."""

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")
        self.extra = torchmetrics.MetricCollection(
            {"prec": torchmetrics.Precision(task="multiclass", num_classes=3)}
        )
        self.val_loss = torchmetrics.MeanMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)  # the object logged: its batch value, then its epoch compute
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_f1_batch", self.val_f1(logits.argmax(-1), y))  # forward's batch value
        self.extra["prec"].update(logits, y)  # updated here, computed in the epoch hook
        self.val_loss.update(nn.functional.cross_entropy(logits, y, reduction="none"))

    def on_validation_epoch_end(self) -> None:
        self.log("val_prec", self.extra["prec"].compute())
        self.log("val_loss", self.val_loss.compute())
        self.extra.reset()
        self.val_loss.reset()


def test_torchmetrics_objects_in_validation_log_as_in_plain_lightning(tmp_path: Path) -> None:
    """Batches of 24 over 64 rows (a short last batch): epoch values are the metrics' own
    compute over every row, not means of batch values."""
    results = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        torch.manual_seed(0)
        trainer = _quiet_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0)
        user = WithMetricObjects()
        trainer.fit(wrap(user), DataLoader(_rows(), 16), DataLoader(_rows(), 24))
        results.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        assert int(user.val_acc._update_count) == 0  # Lightning reset it after the epoch
    assert set(results[0]) == set(results[1]) == {"val_acc", "val_f1_batch", "val_prec", "val_loss"}
    for name, value in results[0].items():
        assert results[1][name] == pytest.approx(value, abs=1e-5), name


class WithTrainMetrics(Small):
    """torchmetrics objects in training_step: logged as objects, on step and on epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.train_f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_f1.update(logits.argmax(-1), y)
        self.log("train_f1", self.train_f1, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_torchmetrics_objects_in_training_log_as_in_plain_lightning(
    tmp_path: Path, accumulate: int
) -> None:
    results = []
    for wrap in (lambda m: m, lambda m: JaxModule.from_lightning(m, print_summary=False)):
        torch.manual_seed(0)
        trainer = _quiet_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=accumulate)
        trainer.fit(wrap(WithTrainMetrics()), DataLoader(_rows(), 16))
        results.append({k: float(v) for k, v in trainer.callback_metrics.items()})
    assert (
        set(results[0])
        == set(results[1])
        == {
            "train_acc",
            "train_acc_step",
            "train_acc_epoch",
            "train_f1",
        }
    )
    for name, value in results[0].items():
        if name == "train_acc_step" and accumulate > 1:
            continue  # (the window's value, where Lightning logs its last batch's: documented)
        assert results[1][name] == pytest.approx(value, abs=1e-5), name


class CarriedLSTM(LightningLSTM):
    """Lightning's demo LSTM (truncated BPTT: self.hidden carried to the next batch), tiny."""

    def __init__(self) -> None:
        super().__init__(vocab_size=20)
        self.model = SimpleLSTM(vocab_size=20, ninp=8, nhid=8, nlayers=1, dropout=0.0)

    def prepare_data(self) -> None:  # (the demo downloads WikiText2)
        pass

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, 20, (32, 6), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids, ids), batch_size=8)


def test_state_a_step_keeps_for_the_next_batch_is_named_not_silently_dropped(
    tmp_path: Path,
) -> None:
    user = CarriedLSTM()
    with pytest.warns(UserWarning, match=r"CarriedLSTM sets self.hidden .*carry it"):
        _quiet_trainer(tmp_path, max_steps=2).fit(
            JaxModule.from_lightning(user, print_summary=False)
        )
    assert user.hidden is None  # no traced value outlives the trace


class LogsItsLr(Small):
    """Logs the scheduled lr from inside training_step, as many modules do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        self.log("last_lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def test_reading_the_lr_in_a_traced_step_is_told_not_silent(tmp_path: Path) -> None:
    user = LogsItsLr()
    jm = JaxModule.from_lightning(user, print_summary=False)
    match = r"LogsItsLr.training_step reads the optimizer's lr.*LearningRateMonitor"
    seen = _fit_warned(jm, tmp_path, match, max_epochs=2)
    assert len([w for w in seen if "reads the optimizer's lr" in str(w.message)]) == 1
    # the optimizer's own param groups and scheduler are back as they were
    optimizer = jm.trainer.optimizers[0]
    assert type(optimizer.param_groups[0]) is dict
    assert "get_last_lr" not in vars(jm.trainer.lr_scheduler_configs[0].scheduler)


@dataclasses.dataclass
class RowsAndLabels:
    """A team's own batch class, as its collate builds it."""

    x: torch.Tensor
    y: torch.Tensor


def _collate_as(kind: str) -> Any:
    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        if kind == "dataclass":
            return RowsAndLabels(x, y)
        from transformers import BatchEncoding  # what transformers' tokenizers and collators give

        return BatchEncoding({"x": x, "y": y})

    return collate


class ReadsItsBatch(Small):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert not isinstance(batch, dict | list | tuple)  # its own type, as plain Lightning
        x, y = (batch.x, batch.y) if isinstance(batch, RowsAndLabels) else (batch["x"], batch["y"])
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, batch_size=x.shape[0])
        return loss


@pytest.mark.parametrize("kind", ["dataclass", "batch_encoding"])
def test_a_collate_that_builds_its_own_batch_type_trains_as_plain_lightning(
    tmp_path: Path, kind: str
) -> None:
    """Before: ``The batch field  holds a BatchEncoding, not a tensor`` (and the same for a
    dataclass): JAX took the whole batch for one leaf. Now such container types become pytree
    nodes at the hand-over and the step gets the type the collate built: the weights and the
    logged loss equal plain Lightning's."""
    loader = DataLoader(_rows(), batch_size=16, collate_fn=_collate_as(kind))
    assert_fit_like_plain(fit_plain_and_ported(ReadsItsBatch, tmp_path, loader), 1e-4, 1e-5)


def test_a_flax_model_reads_a_dataclass_batch_by_field_name(tmp_path: Path) -> None:
    """The Flax path names a dataclass batch by its fields, as it names a namedtuple's."""
    import optax

    import jaxcore
    from jaxcore.models.digits import MLP

    jm = JaxModule(MLP(features=(16,), num_classes=3), jaxcore.softmax_cross_entropy,
                   optax.sgd(0.1), print_summary=False)  # fmt: skip
    loader = DataLoader(_rows(), batch_size=16, collate_fn=_collate_as("dataclass"))
    losses = _fit(jm, loader, tmp_path, max_epochs=2).series("train/loss")
    assert len(losses) == 8 and np.isfinite(losses).all() and losses[-1] < losses[0]


class BagWithIds(Bag):
    """Returns the batch's ids beside its predictions (to write them out), and checks them
    in validation."""

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        return {"id": batch["id"], "pred": self.head(self.emb(batch["tokens"]).mean(1))}

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert outputs["id"] == batch["id"]

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        h = self.emb(batch["tokens"]).mean(1)
        return {"id": batch["id"], "label": self.head(h).argmax(-1)}


def test_an_evaluation_step_returning_the_batchs_ids_gives_them_back(tmp_path: Path) -> None:
    """Before: ``traced for jit returned a value of type <class 'str'>`` when
    ``predict_step`` returned the batch's string ids. Now a field the step returns untouched
    comes back as the DataLoader made it: ids and predictions equal plain Lightning's. (The
    sanity check's validation batch, the first one the port sees, used to fail on the string
    field before any of this: ``'str' object has no attribute 'shape'``.)"""
    loaders = DataLoader(Tokens(), batch_size=16), DataLoader(Tokens(), batch_size=16)
    runs = fit_plain_and_ported(BagWithIds, tmp_path, *loaders, max_epochs=1)
    predictions = {
        mode: trainer.predict(module, DataLoader(Tokens(), batch_size=20))
        for mode, (trainer, module) in runs.items()
    }
    for want, got in zip(predictions["plain"], predictions["jax"], strict=True):
        assert got["id"] == want["id"]
        # (argmax computes as int32 in the step, x64 off; it comes back as torch's int64)
        torch.testing.assert_close(got["label"], want["label"])


class TrainsWithIds(Bag):
    """``training_step`` returns the batch's ids and keeps them in a list, as Lightning 2's
    migration guide writes ``self.training_step_outputs.append(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []
        self.kept: list[Any] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.kept.append({"id": batch["id"], "n": batch["tokens"].shape[0]})
        return {"loss": loss, "id": batch["id"]}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs["id"])


def test_a_training_step_returning_the_batchs_ids_gives_them_to_the_hooks(
    tmp_path: Path,
) -> None:
    """Before: ``on_train_batch_end``'s ``outputs["id"]`` (and the list the step appended
    to) held the stand-in of the string field, which raised when read. Now the DataLoader's
    ids, as in plain Lightning."""
    runs = fit_plain_and_ported(
        TrainsWithIds, tmp_path, DataLoader(Tokens(), batch_size=16), max_epochs=1
    )
    plain, ported = runs["plain"][1], runs["jax"][1].torch_module
    assert ported.seen == plain.seen and len(plain.seen) > 1
    assert [k["id"] for k in ported.kept] == [k["id"] for k in plain.kept]
    assert_fit_like_plain(runs, 1e-5, 1e-6)
