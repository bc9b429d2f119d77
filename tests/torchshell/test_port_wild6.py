"""Round 6 of modules as public projects write them (tests/torchshell/wild6_modules.py):
SimCLR's NT-Xent, a multitask model with a ModuleDict of heads and a ParameterList of task
weights, HiFi-GAN's weight_norm, char-RNNs, a MetricCollection computed at the epoch's end
with ``val_check_interval=0.5`` and ``trainer.test(ckpt_path="best")``, extra checkpoint
keys and a mid-epoch resume, the UvA ``GenerateCallback``, a dict ``predict_step`` with a
``BasePredictionWriter``, a DataModule read in ``setup``, Lightning docs' warm-up in
``optimizer_step``, and a mixture of experts through ``from_torch``. Each runs in plain
Lightning (or torch) and through coreshell on the same loaders: losses per step and final
weights agree, or the pattern is refused with the cause and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from tests.torchshell import wild6_modules as W
from tests.torchshell.port_helpers import agree as _same
from tests.torchshell.test_port_wild3 import _pair, _trainer
from torchshell import JaxModule
from torchshell._errors import ConfigError


def _table(n: int = 64, seed: int = 0) -> DataLoader:
    """Four batches of 16 (no ragged last batch)."""
    return DataLoader(W.table(n, seed), batch_size=16)


def test_simclr_nt_xent_on_masks_built_from_shapes(tmp_path: Path) -> None:
    loaders = DataLoader(W.views(32, 0), batch_size=8), DataLoader(W.views(16, 1), batch_size=8)
    runs = _pair(W.SimCLR, tmp_path, *loaders)
    _same(runs, ("train_loss", "train_acc_top1", "train_acc_mean_pos", "val_loss"), rtol=1e-3)


def test_multitask_module_dict_heads_and_parameter_list_weights(tmp_path: Path) -> None:
    loaders = (DataLoader(W.multitask(64, 0), batch_size=16),)
    loaders += (DataLoader(W.multitask(32, 1), batch_size=16),)
    runs = _pair(W.MultiTask, tmp_path, *loaders)
    series = ("train/cls_step", "train/reg_epoch", "train/total", "train/w_cls", "val/reg")
    _same(runs, series, rtol=1e-4)


@pytest.mark.parametrize("legacy", [False, True], ids=["parametrization", "legacy_hook"])
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
@pytest.mark.filterwarnings("error:.*sets self\\..*weight")
def test_hifigan_weight_norm_convolutions(tmp_path: Path, legacy: bool) -> None:
    # the legacy hook sets conv.weight from weight_g/weight_v before every forward: it was
    # named as state carried to the next batch ("sets self.pre.weight to a value computed
    # from the batch or the weights ... every step sees the attribute as it was before")
    _same(_pair(lambda: W.Vocoder(legacy), tmp_path, _table()), rtol=1e-4)


def test_char_rnn_with_its_hidden_state_made_afresh_every_batch(tmp_path: Path) -> None:
    _same(_pair(W.CharRNN, tmp_path, DataLoader(W.text(32, 0), batch_size=8)), rtol=1e-4)


def test_metric_collection_clones_half_epoch_validation_and_test_from_best(
    tmp_path: Path,
) -> None:
    def callbacks() -> list[Any]:
        return [ModelCheckpoint(monitor="val_MulticlassAccuracy", mode="max", save_top_k=1)]

    runs = _pair(
        W.CollectionClassifier,
        tmp_path,
        _table(),
        _table(32, 1),
        callbacks=callbacks,
        enable_checkpointing=True,
        val_check_interval=0.5,
    )
    series = ("train_loss", "train_MulticlassAccuracy", "val_loss", "val_MulticlassRecall")
    _same(runs, series)
    assert len(runs["jax"][0].logger.series("val_MulticlassAccuracy")) == 4
    tested = {}
    for mode, (trainer, _) in runs.items():
        best = trainer.checkpoint_callback.best_model_path
        assert best
        module = trainer.lightning_module
        tested[mode] = trainer.test(module, _table(32, 2), ckpt_path="best", verbose=False)
    assert tested["jax"][0].keys() == tested["plain"][0].keys()
    for name, value in tested["plain"][0].items():
        np.testing.assert_allclose(tested["jax"][0][name], value, rtol=1e-5, err_msg=name)


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch")
@pytest.mark.filterwarnings("ignore:The dirpath has changed from")
def test_extra_checkpoint_keys_and_a_mid_epoch_resume(tmp_path: Path) -> None:
    def fit(mode: str, ckpt_path: str | None = None) -> tuple[L.Trainer, W.WithVocab, Path]:
        torch.manual_seed(0)
        user = W.WithVocab()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        root = tmp_path / mode / ("resumed" if ckpt_path else "first")
        ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)
        trainer = _trainer(root, enable_checkpointing=True, callbacks=[ckpt])
        trainer.fit(module, _table(), ckpt_path=ckpt_path)
        return trainer, user, root

    resumed, saved = {}, {}
    for mode in ("plain", "jax"):
        _, _, root = fit(mode)
        saved[mode] = torch.load(root / "epoch=0-step=3.ckpt", weights_only=False)
        resumed[mode] = fit(mode, str(root / "epoch=0-step=3.ckpt"))
        loaded = W.WithVocab.load_from_checkpoint(root / "epoch=1-step=6.ckpt")
        assert loaded.loaded_vocab == {"a": 0, "b": 1, "c": 2}
    # (ModelCheckpoint's on_train_batch_end runs before the module's: 2 batches counted)
    assert saved["jax"]["vocab"] == saved["plain"]["vocab"] == {"a": 0, "b": 1, "c": 2}
    assert saved["jax"]["seen_batches"] == saved["plain"]["seen_batches"] == 2
    (ref, plain, _), (ours, user, _) = resumed["plain"], resumed["jax"]
    assert user.loaded_vocab == plain.loaded_vocab == {"a": 0, "b": 1, "c": 2}
    assert user.seen_batches == plain.seen_batches
    assert ours.global_step == ref.global_step
    np.testing.assert_allclose(
        ours.logger.series("train_loss"), ref.logger.series("train_loss"), rtol=1e-5
    )
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(user.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_generate_callback_switches_modes_and_reads_hparams(tmp_path: Path) -> None:
    seen: list[W.GenerateCallback] = []

    def callbacks() -> list[Any]:
        seen.append(W.GenerateCallback(torch.linspace(-1, 1, 24).reshape(3, 8)))
        return [seen[-1]]

    runs = _pair(W.DropoutBNNet, tmp_path, _table(), callbacks=callbacks)
    _same(runs, rtol=1e-4)
    plain, ours = seen
    assert len(ours.seen) == len(plain.seen) == 2
    for (latent, out, training), (want_latent, want, want_training) in zip(
        ours.seen, plain.seen, strict=True
    ):
        assert latent == want_latent == 4 and training == want_training
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_predict_step_returning_a_dict_to_a_prediction_writer(tmp_path: Path) -> None:
    runs = _pair(W.DictPredictor, tmp_path, _table())
    _same(runs, rtol=1e-4)
    got = {}
    for mode, (trainer, _) in runs.items():
        writer = W.CollectWriter()
        predictor = L.Trainer(
            accelerator="cpu", logger=False, callbacks=[writer], enable_progress_bar=False
        )
        out = predictor.predict(trainer.lightning_module, DataLoader(W.table(20, 3), batch_size=8))
        got[mode] = (out, writer)
    (out, writer), (want, want_writer) = got["jax"], got["plain"]
    assert [i for i, _ in writer.batches] == [i for i, _ in want_writer.batches] == [0, 1, 2]
    assert len(writer.epoch) == len(want_writer.epoch) == 1
    assert len(writer.epoch[0]) == len(want_writer.epoch[0]) == 3  # one loader's batches
    for batch, expected in zip(out, want, strict=True):
        assert batch.keys() == expected.keys() == {"preds", "probs", "target"}
        assert batch["preds"].dtype == expected["preds"].dtype == torch.int64
        torch.testing.assert_close(batch["probs"], expected["probs"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batch["target"], expected["target"])


def test_datamodule_setup_read_by_the_module_and_its_batch_transfer_hook(tmp_path: Path) -> None:
    runs = _pair(W.HeadFromDataModule, tmp_path, W.PixelData())
    _same(runs, ("train_loss", "val_acc"))
    assert runs["jax"][1].head.weight.shape == (3, 16)


def test_plateau_on_a_validation_metric_validated_every_other_epoch(tmp_path: Path) -> None:
    runs = _pair(
        W.PlateauEveryOtherEpoch,
        tmp_path,
        _table(),
        _table(32, 1),
        callbacks=lambda: [LearningRateMonitor()],
        max_epochs=6,
        check_val_every_n_epoch=2,
    )
    _same(runs, ("train_loss", "val_loss", "lr-SGD"), rtol=1e-4)
    lrs = runs["jax"][0].logger.series("lr-SGD")
    assert lrs[0] == 0.5 and lrs[-1] == 0.25  # lowered once, after the second validation


def test_bf16_true_precision_casts_the_batch_as_lightning_does(tmp_path: Path) -> None:
    # Lightning's bf16-true casts the batch to bfloat16: the first batch's look for host
    # reads traced it against the float32 weights and refused it ("F.linear ... got operands
    # of different dtypes (input bfloat16, weight float32"); the compiled step computes in
    # bfloat16 with float32 weights and optimizer state (plain Lightning: all bfloat16)
    loaders = (DataLoader(W.multitask(64, 0), batch_size=16),)
    loaders += (DataLoader(W.multitask(32, 1), batch_size=16),)
    runs = _pair(W.MultiTask, tmp_path, *loaders, precision="bf16-true")
    for name in ("train/total", "val/reg"):
        got, want = (runs[m][0].logger.series(name) for m in ("jax", "plain"))
        assert len(got) == len(want) > 0
        np.testing.assert_allclose(got, want, rtol=5e-2, err_msg=name)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (W.WarmupInOptimizerStep, r"\['optimizer_step'\].*Fix.*warm-up.*LambdaLR.*\"step\""),
        (W.TimmScheduler, r"\['lr_scheduler_step'\].*Fix.*not a torch LRScheduler.*LambdaLR"),
    ],
    ids=["optimizer_step_warmup", "timm_lr_scheduler_step"],
)
def test_hooks_that_step_the_torch_optimizer_are_refused_with_the_fix(
    make: Any, match: str
) -> None:
    torch.manual_seed(0)
    # (was: the generic "remove the override", no word on the warm-up or the scheduler)
    with pytest.raises(ConfigError, match=match):
        JaxModule.from_lightning(make(), print_summary=False)


def test_from_torch_mixture_of_experts_in_parameter_list_and_dict(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        net = W.MixtureOfExperts()
        return net, torch.optim.Adam(net.parameters(), lr=1e-2)

    net, opt = build()
    for _ in range(2):
        for x, y in _table():
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    want = net.state_dict()
    net, opt = build()
    module = JaxModule.from_torch(net, nn.CrossEntropyLoss(), opt, print_summary=False)
    _trainer(tmp_path).fit(module, _table())
    got = module.torch_state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)
