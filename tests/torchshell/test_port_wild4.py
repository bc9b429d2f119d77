"""Round 4 of modules as users write them (tests/torchshell/wild4_modules.py): a
LightningDataModule with random_split and test/predict, mixup's random lambda, gradient
checkpointing, an EMA kept in a host hook, multi-label and class-weighted heads, uint8
images with string ids, float16 features, clipping in on_before_optimizer_step, packed
LSTMs, tensors made on ``self.device``, a ``torch.compile``'d network, and plain
``nn.Module``s through ``from_torch`` against a plain torch loop. Each runs in plain
Lightning (or torch) and through coreshell on the same loaders: losses per step and final
weights agree, or the pattern is refused with the cause and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell import wild4_modules as W
from tests.torchshell.port_helpers import agree as _same
from tests.torchshell.test_port_wild3 import _pair, _trainer
from torchshell import JaxModule
from torchshell._errors import TorchModelError


def _table(n: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> DataLoader:
    """Four batches of 16 (no ragged last batch)."""
    return DataLoader(W.table(n, seed, dtype=dtype), batch_size=16)


# -- modules used by one test each (wild4_modules.py holds the rest) -------------------------


# -- a torch.compile'd network inside the LightningModule (PyTorch 2 tutorials) ---------


class CompiledNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.NAdam(self.parameters(), lr=1e-2)


# -- a torch.autocast region of the user's own in training_step ------------------------


class AutocastRegion(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float(), y)
        self.log("logits_bf16", float(logits.dtype == torch.bfloat16))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- transformers' Wav2Vec2ForCTC fine-tuned with its default SpecAugment and LayerDrop --


class Wav2Vec2Finetune(L.LightningModule):
    """Its masks and layer drops are drawn with ``np.random`` inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        config = Wav2Vec2Config(
            vocab_size=8,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
            layerdrop=0.1,
            mask_time_prob=0.05,
            mask_time_length=2,
        )
        self.model = Wav2Vec2ForCTC(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        audio, labels = batch
        return self.model(audio, labels=labels).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


# -- plain nn.Modules for JaxModule.from_torch ----------------------------------------------


class TinyCNN(nn.Module):
    """A PyTorch-tutorial CNN: Conv, BatchNorm, Dropout(0), MaxPool, flatten, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


class ResidualMLP(nn.Module):
    """An MLP with LayerNorm and a residual, trained with AdamW's two param groups."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + F.gelu(self.hidden(self.norm(h)))
        return self.out(h)


def no_decay_groups(net: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The AdamW grouping of public fine-tuning scripts: no decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in net.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def test_datamodule_with_random_split_hparams_lr_test_and_predict(tmp_path: Path) -> None:
    # prepare_data + setup(stage) + random_split, self.hparams.lr, log_dict(prog_bar=True),
    # trainer.test and trainer.predict (argmax) on the datamodule's own loaders
    out: dict[str, Any] = {}
    for mode in ("plain", "jax"):
        torch.manual_seed(0)
        user = W.LitClassifier()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        data = W.TableData(str(tmp_path))
        trainer = _trainer(tmp_path / mode)
        trainer.fit(module, datamodule=data)
        tested = trainer.test(module, datamodule=data, verbose=False)
        predicted = trainer.predict(module, datamodule=data)
        out[mode] = (trainer, user, tested, predicted)
    _same({m: out[m][:2] for m in out}, ("train_loss", "train_acc", "val_acc"), rtol=1e-4)
    (_, _, tested, predicted), (*_, want_tested, want_predicted) = out["jax"], out["plain"]
    assert tested[0].keys() == want_tested[0].keys() == {"test_loss", "test_acc"}
    for name, value in want_tested[0].items():
        np.testing.assert_allclose(tested[0][name], value, rtol=1e-4, err_msg=name)
    assert [p.dtype for p in predicted] == [torch.int64]
    assert [p.tolist() for p in predicted] == [p.tolist() for p in want_predicted]


def test_a_numpy_draw_in_training_step_is_refused_naming_the_torch_draw(
    tmp_path: Path,
) -> None:
    # np.random.beta drew one lambda at trace time and the compiled step reused it on every
    # batch, silently (logged lam: 0.80213 eight times, plain Lightning: eight draws)
    torch.manual_seed(0)
    with pytest.raises(
        TorchModelError,
        match=r"np\.random\.beta\(\) was called while the step is traced \(at .*"
        r"wild4_modules\.py:\d+\).*reuse that number on every batch.*"
        r"torch\.distributions\.Beta\(a, a\)\.sample\(\)",
    ):
        _trainer(tmp_path).fit(
            JaxModule.from_lightning(W.MixupNumpy(), print_summary=False), _table()
        )
    assert 0.0 <= float(np.random.beta(0.4, 0.4)) <= 1.0  # numpy is itself again afterwards


def test_a_library_layers_numpy_draw_is_refused_naming_its_config(tmp_path: Path) -> None:
    # wav2vec2's SpecAugment mask and LayerDrop (np.random in transformers' forward) were
    # drawn once and baked into the compiled step: the same frames masked, the same layers
    # dropped, every step
    g = torch.Generator().manual_seed(0)
    audio, labels = torch.randn(8, 800, generator=g), torch.randint(1, 8, (8, 5), generator=g)
    torch.manual_seed(0)
    with pytest.raises(
        TorchModelError,
        match=r"np\.random\.rand\(\) was called while the step is traced \(at .*"
        r"modeling_wav2vec2\.py:\d+\).*library's layer.*layerdrop=0\.0, mask_time_prob=0\.0",
    ):
        _trainer(tmp_path, max_steps=1).fit(
            JaxModule.from_lightning(Wav2Vec2Finetune(), print_summary=False),
            DataLoader(TensorDataset(audio, labels), batch_size=4),
        )


def test_mixup_with_a_torch_beta_draws_anew_every_step(tmp_path: Path) -> None:
    # torch.distributions.Beta(a, a).sample(): "torchax cannot lower aten::_is_all_true",
    # then aten::_sample_dirichlet; now drawn from the step's key, a new lambda every step
    runs = _pair(W.MixupTorchBeta, tmp_path, _table())
    lam = runs["jax"][0].logger.series("lam")
    assert len(lam) == 8 and len(set(lam)) == 8 and all(0.0 < v < 1.0 for v in lam)
    loss, want = (runs[m][0].logger.series("train_loss") for m in ("jax", "plain"))
    assert np.all(np.isfinite(loss))
    np.testing.assert_allclose(np.mean(loss), np.mean(want), rtol=0.05)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_trains_as_plain_lightning(tmp_path: Path, reentrant: bool) -> None:
    _same(_pair(lambda: W.Checkpointed(reentrant), tmp_path, _table()), rtol=1e-4)


def test_an_ema_of_the_weights_kept_in_on_train_batch_end(tmp_path: Path) -> None:
    # the hook reads the current weights each batch; the EMA copy and its val loss match
    runs = _pair(W.EmaInHook, tmp_path, _table(), _table(32, 1))
    _same(runs, ("train_loss", "val_loss_ema"), rtol=1e-4)


def test_multi_label_pos_weight_log_dict_and_one_cycle_per_step(tmp_path: Path) -> None:
    runs = _pair(W.MultiLabel, tmp_path, _table())
    _same(runs, ("train_loss_step", "train_loss_epoch", "train_hamming_step"), rtol=1e-4)


def test_uint8_images_with_string_ids_class_weights_and_predicted_ids(tmp_path: Path) -> None:
    # self.log(..., batch_size=len(batch["id"])) on a list of strings was refused ("holds a
    # list, not a tensor"): its length is static, as a tensor's shape; predict_step returns
    # the ids beside the predictions, as in plain Lightning
    loader = DataLoader(W.Images(48, 0), batch_size=16)
    runs = _pair(W.ImageNet, tmp_path, loader)
    _same(runs, rtol=1e-4)
    preds = {}
    for mode, (trainer, user) in runs.items():
        module = trainer.lightning_module if mode == "jax" else user
        preds[mode] = trainer.predict(module, DataLoader(W.Images(20, 1), batch_size=8))
    assert [p["id"] for p in preds["jax"]] == [p["id"] for p in preds["plain"]]
    assert preds["jax"][0]["id"][:2] == ["img_0000", "img_0001"]
    for got, want in zip(preds["jax"], preds["plain"], strict=True):
        torch.testing.assert_close(got["pred"], want["pred"])


def test_float16_features_cast_in_the_model_smooth_l1_regression(tmp_path: Path) -> None:
    _same(_pair(W.HalfInputRegressor, tmp_path, _table(dtype=torch.float16)), rtol=1e-4)


def test_clip_grad_norm_in_on_before_optimizer_step_with_warm_restarts(tmp_path: Path) -> None:
    runs = _pair(W.ClipsInHook, tmp_path, _table())
    _same(runs, ("train_loss", "grad_norm"), rtol=1e-4)
    assert max(runs["jax"][0].logger.series("grad_norm")) > 0.5  # clipping did bite


def test_bidirectional_lstm_over_packed_sequences(tmp_path: Path) -> None:
    runs = _pair(W.PackedLSTM, tmp_path, DataLoader(W.Sentences(32, 0), batch_size=8))
    _same(runs, rtol=1e-3)  # Adam (docs/porting.md: Adam to 1e-3)


@pytest.mark.parametrize("make", [W.DeviceTensors, CompiledNet], ids=["device", "compiled"])
def test_tensors_on_self_device_and_a_torch_compiled_network(tmp_path: Path, make: Any) -> None:
    _same(_pair(make, tmp_path, _table()), rtol=1e-4)


def _torch_loop(net: torch.nn.Module, loss: Any, opt: Any, loader: DataLoader) -> list[float]:
    losses = []
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            value = loss(net(x), y)
            value.backward()
            opt.step()
            losses.append(value.item())
    return losses


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_from_torch_tutorial_models_match_a_plain_torch_loop(tmp_path: Path, kind: str) -> None:
    # cnn: uint8 images scaled, BatchNorm2d in train mode, label smoothing, SGD + decay;
    # mlp: LayerNorm residual, class-weighted loss, AdamW with the no-decay param groups
    def build() -> tuple[torch.nn.Module, Any, Any, DataLoader]:
        torch.manual_seed(0)
        if kind == "cnn":
            net: torch.nn.Module = TinyCNN()
            images = W.Images(48, 0)
            data = TensorDataset(images.images.float() / 255, images.labels)
            loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        else:
            net = ResidualMLP()
            data = W.table(64, 0)
            loss = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
            opt = torch.optim.AdamW(no_decay_groups(net, 0.05), lr=1e-2)
        return net, loss, opt, DataLoader(data, batch_size=16)

    net, loss, opt, loader = build()
    _torch_loop(net, loss, opt, loader)
    want = net.state_dict()
    net, loss, opt, loader = build()
    module = JaxModule.from_torch(net, loss, opt, inputs=(0,), print_summary=False)
    trainer: L.Trainer = _trainer(tmp_path)
    trainer.fit(module, loader)
    got = module.torch_state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_a_torch_autocast_region_in_training_step_computes_in_bfloat16(tmp_path: Path) -> None:
    # torchax ignored torch's autocast state: the region computed in float32, silently
    # (logits_bf16 logged 0.0, losses equal to a float32 run's)
    runs = _pair(AutocastRegion, tmp_path, _table())
    assert runs["jax"][0].logger.series("logits_bf16") == [1.0] * 8
    # to bfloat16's rounding (torch's addmm rounds once, XLA's dot and bias add twice)
    loss, want = (runs[m][0].logger.series("train_loss") for m in ("jax", "plain"))
    np.testing.assert_allclose(loss, want, rtol=2e-3)
    got = runs["jax"][1].state_dict()
    for name, value in runs["plain"][1].state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=2e-3, atol=1e-4, msg=name)
