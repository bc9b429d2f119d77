"""torchaudio inside a team's LightningModule, through ``from_lightning``, against plain
Lightning: a ``Conformer`` fed lengths (it reads ``int(lengths.max())`` in Python: a batch
scalar, one compiled step per value) and SpecAugment masks in ``training_step`` (torchaudio
checks a traced value and raises on one outcome), and a transformers `Wav2Vec2ForCTC` trained
with `labels=`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchaudio
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers import assert_fit_like_plain, fit_plain_and_ported, quiet_trainer
from torchshell import JaxModule


class Clips(Dataset):
    """Feature sequences of 20-36 frames and a class."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(20 + i % 17, 40, generator=g), i % 4


def collate(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Padded to the batch's longest clip, with the lengths (as torchaudio models take them)."""
    lengths = torch.tensor([x.shape[0] for x, _ in items])
    longest = int(lengths.max())
    features = torch.stack([F.pad(x, (0, 0, 0, longest - x.shape[0])) for x, _ in items])
    return {"features": features, "lengths": lengths, "label": torch.tensor([y for _, y in items])}


def _loader() -> DataLoader:
    return DataLoader(Clips(), batch_size=12, collate_fn=collate)


class ConformerClassifier(L.LightningModule):
    def __init__(self, spec_augment: bool = False, loud: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torchaudio.models.Conformer(
            input_dim=40, num_heads=2, ffn_dim=32, num_layers=1, depthwise_conv_kernel_size=3
        )
        self.head = nn.Linear(40, 4)
        self.mask = torchaudio.transforms.FrequencyMasking(8) if spec_augment else None
        self.loud = loud

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, lengths = self.encoder(features, lengths)
        valid = (torch.arange(out.shape[1])[None] < lengths[:, None]).float()[..., None]
        return self.head((out * valid).sum(1) / valid.sum(1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["features"]
        if self.loud is not None and (x.abs() > self.loud).any():
            raise ValueError(f"a frame louder than {self.loud}: check the feature scaling")
        if self.mask is not None:
            x = self.mask(x.transpose(1, 2)).transpose(1, 2)
        loss = F.cross_entropy(self(x, batch["lengths"]), batch["label"])
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["features"], batch["lengths"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(module: L.LightningModule, tmp_path: Path) -> L.Trainer:
    trainer = quiet_trainer(max_epochs=2, default_root_dir=tmp_path)
    trainer.fit(module, _loader(), _loader())
    return trainer


def test_a_torchaudio_conformer_module_trains_as_plain_lightning(tmp_path: Path) -> None:
    """Before: "needs a tensor's value in Python" at the Conformer's
    ``int(torch.max(lengths).item())``. Now the read is found on the first batch and handed
    to the step as a static value (one compilation per distinct longest clip)."""
    plain_module = ConformerClassifier()
    plain = _fit(plain_module, tmp_path / "plain")
    user = ConformerClassifier()
    module = JaxModule.from_lightning(user, print_summary=False)
    ported = _fit(module, tmp_path / "jax")
    for name in ("loss", "val_loss"):
        assert float(ported.callback_metrics[name]) == pytest.approx(
            float(plain.callback_metrics[name]), rel=1e-4
        )
    reference = plain_module.state_dict()
    for name, value in user.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=2e-5)
    assert module.compiled.train.recompiles >= 1  # batches of several longest lengths


def test_spec_augment_in_training_step_trains_and_a_failing_check_raises(tmp_path: Path) -> None:
    """torchaudio's masking raises ``ValueError`` on one outcome of a traced comparison
    (never taken in torch). Before: that error at trace time. Now the step takes the other
    outcome and raises the check's own error if a batch ever takes it, as torch would: here a
    team's own check (``if (x.abs() > limit).any(): raise``) on data that fails it."""
    masked = JaxModule.from_lightning(ConformerClassifier(True), print_summary=False)
    trainer = _fit(masked, tmp_path)
    assert torch.isfinite(trainer.callback_metrics["loss"])
    checked = JaxModule.from_lightning(ConformerClassifier(loud=3.0), print_summary=False)
    with pytest.raises(Exception, match=r"a frame louder than 3\.0: check the feature scaling"):
        _fit(checked, tmp_path / "loud")


class HFSpeechToText(L.LightningModule):
    """A transformers ``Wav2Vec2ForCTC`` fine-tuned with ``labels=`` (-100 padding), as the
    transformers speech recipes do, with a validation loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        no_dropout = dict.fromkeys(
            ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout",
             "final_dropout", "layerdrop", "mask_time_prob"), 0.0
        )  # fmt: skip
        config = Wav2Vec2Config(
            vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
            ctc_zero_infinity=True, **no_dropout,
        )  # fmt: skip
        self.model = Wav2Vec2ForCTC(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        wav, mask, labels = batch
        loss = self.model(input_values=wav, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss, batch_size=wav.shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        wav, mask, labels = batch
        loss = self.model(input_values=wav, attention_mask=mask, labels=labels).loss
        self.log("val_loss", loss, batch_size=wav.shape[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)


def test_a_transformers_ctc_model_trains_as_plain_lightning(tmp_path: Path) -> None:
    """Before: ``needs a tensor's value in Python`` at transformers' ``ForCTCLoss``
    (``labels.masked_select(mask)``, a shape that depends on values), and torchax could not
    lower ``aten::_ctc_loss``. Now the same loss runs on padded labels (torchshell/trace/_ctc.py):
    per-step losses, the validation loss and the weights equal plain Lightning's."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    wav = torch.randn(24, 1600, generator=g)
    mask = (torch.arange(1600) < torch.randint(800, 1601, (24, 1), generator=g)).long()
    labels = torch.randint(1, 12, (24, 6), generator=g)
    labels = torch.where(torch.arange(6) < torch.randint(1, 7, (24, 1), generator=g), labels, -100)
    data = TensorDataset(wav, mask, labels)
    loaders = DataLoader(data, batch_size=8), DataLoader(data, batch_size=12)
    runs = fit_plain_and_ported(HFSpeechToText, tmp_path, *loaders, max_epochs=1)
    assert set(runs["jax"][0].callback_metrics) == {"train_loss", "val_loss"}
    assert_fit_like_plain(runs, rtol=1e-4, atol=1e-5)
