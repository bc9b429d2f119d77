"""JaxModule.from_lightning logs as plain Lightning does: on-step values at Lightning's own
steps with their ``epoch``, ``trainer.logged_metrics`` after fit, and coreshell's telemetry
under ``system/coreshell.`` beside (never over) the user's names; ``batch_idx`` in a traced
``training_step`` refused when computed with."""

from __future__ import annotations

import copy
import csv
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from mlflow.tracking import MlflowClient
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from tests.torchshell.test_port import Recorder
from tests.torchshell.test_port_manual import GAN
from tests.torchshell.test_port_manual import _loader as gan_loader
from torchshell import JaxModule
from torchshell._errors import ConfigError


class Logs(L.LightningModule):
    """Logs on step, on step and epoch, on epoch only, one value hidden from the loggers, and
    the names coreshell used to log its own values under (``loss``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("both", 2 * loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("acc", (logits.argmax(-1) == y).float().mean(), on_step=False, on_epoch=True)
        self.log("hidden", loss, logger=False)
        self.log("loss", 3 * loss)  # the user's own "loss": coreshell's must not shadow it
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(n: int = 80) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()), 16)


def _trainer(tmp_path: Path, logger: Any, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": logger,
        "log_every_n_steps": 2,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return L.Trainer(**(options | kwargs))


def _rows(rec: Recorder, name: str) -> list[tuple[int, int, float]]:
    """``(step, epoch, value)`` of every row holding ``name``, by step."""
    return sorted((s, int(m["epoch"]), m[name]) for s, m in rec.rows if name in m)


def _fit_both(tmp_path: Path, module: type[L.LightningModule], **kwargs: Any) -> Any:
    runs = {}
    for kind in ("plain", "ported"):
        rec = Recorder()
        trainer = _trainer(tmp_path / kind, rec, **kwargs)
        user = module()
        trainer.fit(user if kind == "plain" else JaxModule.from_lightning(user), _data())
        runs[kind] = (trainer, rec, user)
    return runs


@pytest.mark.parametrize("accumulate", [1, 2])
def test_rows_steps_epochs_and_logged_metrics_are_plain_lightnings(
    accumulate: int, tmp_path: Path
) -> None:
    """5 batches a epoch, 2 epochs, every 2nd step logged; with accumulate_grad_batches=2
    the windows are 2, 2, 1 batches (3 optimizer steps an epoch)."""
    runs = _fit_both(tmp_path, Logs, accumulate_grad_batches=accumulate)
    (t_plain, plain, _), (t_ours, ours, _) = runs["plain"], runs["ported"]
    assert t_plain.global_step == t_ours.global_step
    for name in ("train_loss", "both_step", "loss", "both_epoch", "acc"):
        want, got = _rows(plain, name), _rows(ours, name)
        assert want, name
        # the same steps and epochs (before: steps 1..N, no epoch), the same values
        assert [(s, e) for s, e, _ in got] == [(s, e) for s, e, _ in want], name
        np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want], rtol=1e-5)
    assert not _rows(ours, "hidden") and not _rows(plain, "hidden")
    # everything coreshell adds is under system/coreshell., and it is logged (throughput, transfers)
    user = {k for _, m in plain.rows for k in m}
    added = {k for _, m in ours.rows for k in m} - user
    assert added and all(k.startswith("system/coreshell.") for k in added), sorted(added)
    assert {"system/coreshell.perf.samples_per_s", "system/coreshell.train.loss"} <= added
    assert any(k.startswith("system/coreshell.compile.") for k in added)
    # logged_metrics and callback_metrics: plain Lightning's names and values, plus
    # system/coreshell.
    for got_, want_ in (
        (t_ours.logged_metrics, t_plain.logged_metrics),
        (t_ours.callback_metrics, t_plain.callback_metrics),
    ):
        mine = {k: float(v) for k, v in got_.items() if not k.startswith("system/coreshell.")}
        theirs = {k: float(v) for k, v in want_.items()}
        assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-5), k
    assert "train_loss" in t_ours.logged_metrics and "samples/s" not in t_ours.callback_metrics
    # the bar: the user's values, and samples/s (not "loss": the user logs that name)
    assert set(t_ours.progress_bar_metrics) == set(t_plain.progress_bar_metrics) | {"samples/s"}


def test_monitoring_the_users_loss_watches_the_users_value(tmp_path: Path) -> None:
    """``ModelCheckpoint(monitor="loss")`` reads the user's ``loss`` (3 x the loss here), not
    coreshell's training loss, at every checkpoint, as in plain Lightning."""
    seen: dict[str, list[float]] = {"plain": [], "ported": []}

    class Watch(L.Callback):
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if "loss" in trainer.callback_metrics:
                seen[self.kind].append(float(trainer.callback_metrics["loss"]))

    for kind in ("plain", "ported"):
        ckpt = L.pytorch.callbacks.ModelCheckpoint(tmp_path / kind, monitor="loss")
        trainer = _trainer(
            tmp_path / kind,
            Recorder(),
            callbacks=[ckpt],
            log_every_n_steps=1,
            enable_checkpointing=True,
        )
        trainer.callbacks.append(Watch(kind))
        user = Logs()
        trainer.fit(user if kind == "plain" else JaxModule.from_lightning(user), _data())
        seen[kind].append(float(ckpt.best_model_score))
    # (coreshell fetches the on-step values at logging steps, so it sees fewer, not others)
    assert seen["ported"][-1] == pytest.approx(seen["plain"][-1], rel=1e-5)
    assert set(np.round(seen["ported"], 5)) <= set(np.round(seen["plain"], 5))


def test_csv_logger_rows_match_plain_lightning(tmp_path: Path) -> None:
    """A real CSVLogger: each (step, epoch) row of the user's names as plain Lightning's."""
    tables = {}
    for kind in ("plain", "ported"):
        logger = CSVLogger(tmp_path / kind, name="run", version=0)
        trainer = _trainer(tmp_path / kind, logger)
        user = Logs()
        trainer.fit(user if kind == "plain" else JaxModule.from_lightning(user), _data())
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        tables[kind] = {
            (r["step"], r["epoch"], k): float(r[k])
            for r in rows
            for k in ("train_loss", "both_step", "both_epoch", "acc", "loss")
            if r.get(k)
        }
    assert tables["ported"].keys() == tables["plain"].keys()
    for key, value in tables["plain"].items():
        assert tables["ported"][key] == pytest.approx(value, rel=1e-5), key


def test_manual_optimization_logs_at_lightnings_steps(tmp_path: Path) -> None:
    """Two optimizers stepped per batch: Lightning logs at batches (not global_step), every
    ``log_every_n_steps``-th batch; the ported GAN the same."""
    rows = {}
    for kind in ("plain", "ported"):
        rec = Recorder()
        trainer = _trainer(tmp_path / kind, rec, max_epochs=1, log_every_n_steps=2)
        gan = GAN("toggle")
        trainer.fit(gan if kind == "plain" else JaxModule.from_lightning(gan), gan_loader())
        rows[kind] = rec
    for name in ("g_loss", "d_loss"):
        want, got = _rows(rows["plain"], name), _rows(rows["ported"], name)
        assert [(s, e) for s, e, _ in got] == [(s, e) for s, e, _ in want] != []
        np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want], rtol=2e-5)


def test_mlflow_store_holds_user_names_and_coreshell_telemetry(tmp_path: Path) -> None:
    """A real MLflow store (SQLite) through coreshell's logger: the user's names at plain
    Lightning's steps, coreshell's figures only under system/coreshell."""
    from torchshell.tracking import AsyncMLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = AsyncMLflowLogger("port-logs", tracking_uri=uri, spill_dir=tmp_path / "spill")
    trainer = _trainer(tmp_path, logger)
    trainer.fit(JaxModule.from_lightning(Logs()), _data())
    report = logger.close()
    assert report.complete, str(report)
    plain = Recorder()
    _trainer(tmp_path / "plain", plain).fit(Logs(), _data())
    client = MlflowClient(uri)
    keys = set(client.get_run(report.run_id).data.metrics)
    assert {"train_loss", "both_step", "both_epoch", "acc", "loss", "epoch"} <= keys
    assert not keys & {"samples/s", "perf/samples_per_s", "compile/recompiles"}
    assert {k for k in keys if "/" in k} and all(
        k.startswith("system/coreshell.") for k in keys if "/" in k
    )
    steps = sorted(m.step for m in client.get_metric_history(report.run_id, "train_loss"))
    assert steps == [s for s, _, _ in _rows(plain, "train_loss")]


class UsesBatchIdx(Logs):
    """A loss weighted by batch_idx: traced once, it would train with batch_idx=0 throughout."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y) * (1 + batch_idx % 3)


class BranchesOnBatchIdx(Logs):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if batch_idx == 0:
            loss = loss * 0
        return loss


class PassesBatchIdx(Logs):
    """batch_idx handed on and printed, never computed with: trains as in plain Lightning."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        print(f"batch {batch_idx}")
        return self._loss(batch, batch_idx)

    def _loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("module", [UsesBatchIdx, BranchesOnBatchIdx])
def test_a_training_step_computing_with_batch_idx_is_refused_before_training(
    module: type[L.LightningModule], tmp_path: Path
) -> None:
    user = module()
    before = copy.deepcopy(user.state_dict())
    trainer = _trainer(tmp_path, Recorder())
    with pytest.raises(ConfigError, match=r"computes with batch_idx.*0, 1, 2.*Fix: .*batch field"):
        trainer.fit(JaxModule.from_lightning(user), _data())
    assert trainer.global_step == 0
    for k, v in user.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_training_step_passing_batch_idx_on_trains_as_plain_lightning(tmp_path: Path) -> None:
    runs = _fit_both(tmp_path, PassesBatchIdx, max_epochs=1)
    assert runs["ported"][0].global_step == runs["plain"][0].global_step == 5
    trained, reference = runs["ported"][2].state_dict(), runs["plain"][2].state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6)


# -- evaluation hooks: batch_idx, and the rows a DistributedSampler repeats -----------------
class Validates(Logs):
    """A validation_step and test_step as projects write them, batch_idx passed along."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._eval_loss(batch, batch_idx))

    def test_step(self, batch: Any) -> None:  # (Lightning calls it without batch_idx)
        self.log("test_loss", self._eval_loss(batch, 0))

    def _eval_loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class FirstBatchOnly(Validates):
    """Computes on batch_idx in validation_step: traced once, every batch would be batch 0."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._eval_loss(batch, batch_idx)
        if batch_idx == 0:
            self.log("first_val_loss", loss)
        self.log("val_loss", loss)


def _val_data(n: int = 10, **sampler: Any) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    if not sampler:
        return DataLoader(data, batch_size=2)
    return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, **sampler))


def test_eval_hooks_with_and_without_batch_idx_match_plain_lightning(tmp_path: Path) -> None:
    values = {}
    for kind in ("plain", "ported"):
        trainer = _trainer(tmp_path / kind, Recorder(), max_epochs=1)
        user = Validates()
        module = user if kind == "plain" else JaxModule.from_lightning(user)
        trainer.fit(module, _data(), _val_data())
        val = float(trainer.callback_metrics["val_loss"])
        values[kind] = (val, trainer.test(module, _val_data(), verbose=False)[0]["test_loss"])
    np.testing.assert_allclose(values["ported"], values["plain"], rtol=1e-5)


def test_a_validation_step_computing_with_batch_idx_is_refused_before_training(
    tmp_path: Path,
) -> None:
    user = FirstBatchOnly()
    before = copy.deepcopy(user.state_dict())
    trainer = _trainer(tmp_path, Recorder())  # (the sanity check traces validation_step)
    with pytest.raises(
        ConfigError,
        match=r"FirstBatchOnly.validation_step computes with batch_idx.*"
        r"Fix: .*on_validation_batch_end",
    ):
        trainer.fit(JaxModule.from_lightning(user), _data(), _val_data())
    assert trainer.global_step == 0
    for k, v in user.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_rows_a_distributed_sampler_repeats_are_not_evaluated(tmp_path: Path) -> None:
    """10 rows over 3 replicas: replica 2 gets rows 2, 5, 8 and row 1 again (to even out the
    shards); its validation and test values are those of rows 2, 5, 8, as in plain Lightning
    over those rows alone (batches of 2: [2, 5], [8])."""
    shard = {"num_replicas": 3, "rank": 2, "shuffle": False}
    assert [int(i) for i in DistributedSampler(range(10), **shard)] == [2, 5, 8, 1]
    own = DataLoader(Subset(_val_data().dataset, [2, 5, 8]), batch_size=2)
    with_repeat = DataLoader(Subset(_val_data().dataset, [2, 5, 8, 1]), batch_size=2)
    values = {}
    for kind, loader, make in (
        ("plain", own, lambda u: u),
        ("repeat", with_repeat, lambda u: u),  # (what the repeat would change)
        ("ported", _val_data(**shard), JaxModule.from_lightning),
    ):
        rec = Recorder()
        trainer = _trainer(tmp_path / kind, rec, max_epochs=1, num_sanity_val_steps=0)
        module = make(Validates())
        trainer.fit(module, _data(), loader)
        val = [m["val_loss"] for _, m in rec.rows if "val_loss" in m]
        test = trainer.test(module, loader, verbose=False)
        values[kind] = (val[-1], test[0]["test_loss"])
    np.testing.assert_allclose(values["ported"], values["plain"], rtol=1e-5)
    assert not np.allclose(values["repeat"], values["plain"], rtol=1e-3)


def test_flax_path_telemetry_is_under_coreshell_and_the_bar_still_shows_the_loss(
    tmp_path: Path,
) -> None:
    """The Flax path logs its model's values as ``train/*`` and coreshell's figures under
    ``system/coreshell.``; the bar's loss and samples/s are not in ``callback_metrics``."""
    import jaxcore
    from jaxcore.models.digits import MLP
    from torchshell.data.digits import DigitsDataModule

    module = JaxModule(
        MLP(features=(16,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        print_summary=False,
    )
    rec = Recorder()
    trainer = _trainer(tmp_path, rec, max_epochs=None, max_steps=6, log_every_n_steps=2)
    trainer.fit(module, DigitsDataModule(batch_size=32))
    keys = {k for _, m in rec.rows for k in m}
    assert "train/loss" in keys and "system/coreshell.perf.samples_per_s" in keys
    assert all(k.startswith(("train/", "system/coreshell.")) or k == "epoch" for k in keys), keys
    assert not {"loss", "samples/s"} & set(trainer.callback_metrics)
    assert {"loss", "samples/s"} <= set(trainer.progress_bar_metrics)
