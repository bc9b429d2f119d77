"""The spoken-digits recipe's data: eSpeak NG voices, torchaudio features in DataLoader workers.

WAVs (16 kHz mono, built offline by :func:`ensure_spoken_digits`) are read in the workers,
resampled where needed, augmented for training (time shift, gain, added noise), turned into a
log-mel spectrogram, SpecAugment-ed for training, and collated into a few length buckets with a
frame mask: ``{"features": float32[B, T, n_mels], "frame_mask": bool[B, T], "y": int32[B]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
import torchaudio
from torch import nn
from torch.utils.data import Dataset

from torchshell.data._module import SplitDataModule
from torchshell.data._spoken_digits_build import (
    DIGITS,
    SAMPLE_RATE,
    SpokenDigitsDataError,
    default_root,
    ensure_spoken_digits,
    load_manifest,
)

__all__ = [
    "DIGITS",
    "SAMPLE_RATE",
    "BucketCollate",
    "LogMel",
    "SpokenDigitsDataError",
    "SpokenDigitsDataModule",
    "SpokenDigitsDataset",
    "default_root",
    "ensure_spoken_digits",
]


class LogMel(nn.Module):
    """Waveform -> normalised log-mel frames, Whisper-style (log10, 8-decade floor, scaled).

    The serving model reuses this module, so training and serving features are the same code.

    Args:
        sample_rate: of the input waveform.
        n_mels: mel bands.
        n_fft: FFT size (25 ms at 16 kHz).
        hop_length: frame step (10 ms at 16 kHz).

    Example:
        >>> LogMel()(torch.zeros(2, 16000)).shape
        torch.Size([2, 101, 40])
    """

    def __init__(
        self,
        sample_rate: int = SAMPLE_RATE,
        n_mels: int = 40,
        n_fft: int = 400,
        hop_length: int = 160,
    ) -> None:
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels
        )

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # wave: [..., N] -> [..., T, n_mels]
        x = torch.log10(torch.clamp(self.mel(wave), min=1e-10))
        peak = x.amax(dim=(-2, -1), keepdim=True)
        x = torch.maximum(x, peak - 8.0)
        return ((x + 4.0) / 4.0).transpose(-1, -2)


class SpokenDigitsDataset(Dataset[dict[str, torch.Tensor]]):
    """One split of a built set as ``{"features": float32[T, n_mels], "y": int32}``.

    Args:
        folder: a folder made by :func:`ensure_spoken_digits`.
        split: ``train``, ``val`` or ``test``.
        train: apply the training augmentations (shift, gain, noise, SpecAugment).
        n_mels: mel bands.
        max_frames: longer clips are cropped to this many frames.
        max_shift_s: training time shift: up to this much silence is put in front.
        gain_db: training gain is uniform in ``[-gain_db, gain_db]``.
        snr_db: training noise is white, at a signal-to-noise ratio uniform in this range.
        freq_mask: SpecAugment frequency mask width (bands).
        time_mask: SpecAugment time mask width (frames).

    Example:
        >>> import tempfile
        >>> folder = ensure_spoken_digits(tempfile.mkdtemp(), takes=1, speakers=3)
        >>> item = SpokenDigitsDataset(folder, "test")[0]
        >>> item["features"].shape[1], item["features"].dtype, item["y"].dtype
        (40, torch.float32, torch.int32)
    """

    def __init__(
        self,
        folder: str | Path,
        split: str,
        *,
        train: bool = False,
        n_mels: int = 40,
        max_frames: int = 128,
        max_shift_s: float = 0.15,
        gain_db: float = 6.0,
        snr_db: Sequence[float] = (10.0, 40.0),
        freq_mask: int = 6,
        time_mask: int = 8,
    ) -> None:
        if split not in ("train", "val", "test"):
            raise SpokenDigitsDataError(
                f"split={split!r}: expected 'train', 'val' or 'test'. Fix: pass one of them."
            )
        self.folder = Path(folder)
        self.clips = [c for c in load_manifest(folder)["clips"] if c["split"] == split]
        self.train = train
        self.max_frames = max_frames
        self.max_shift = int(max_shift_s * SAMPLE_RATE)
        self.gain_db = gain_db
        self.snr_db = tuple(snr_db)
        self.features = LogMel(n_mels=n_mels)
        self.spec_augment = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(freq_mask),
            torchaudio.transforms.TimeMasking(time_mask),
        )
        self._resamplers: dict[int, nn.Module] = {}

    def __len__(self) -> int:
        return len(self.clips)

    def _load(self, path: Path) -> torch.Tensor:
        try:
            data, rate = sf.read(path, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, OSError) as err:
            raise SpokenDigitsDataError(
                f"Cannot read clip {path}: expected a 16-bit mono WAV, got: {err}. Fix: rerun "
                "ensure_spoken_digits(root) (its checksums rebuild damaged or missing files)."
            ) from err
        wave = torch.from_numpy(data.mean(axis=1))  # mono
        if rate != SAMPLE_RATE:
            if rate not in self._resamplers:
                self._resamplers[rate] = torchaudio.transforms.Resample(rate, SAMPLE_RATE)
            wave = self._resamplers[rate](wave)
        return wave

    def _augment(self, wave: torch.Tensor) -> torch.Tensor:
        shift = int(torch.randint(0, self.max_shift + 1, ()))
        wave = torch.nn.functional.pad(wave, (shift, 0))
        gain = (torch.rand(()) * 2 - 1) * self.gain_db
        wave = wave * 10 ** (gain / 20)
        snr = self.snr_db[0] + torch.rand(()) * (self.snr_db[1] - self.snr_db[0])
        power = wave.pow(2).mean().clamp(min=1e-10)
        return wave + torch.randn_like(wave) * torch.sqrt(power / 10 ** (snr / 10))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        clip = self.clips[i]
        with torch.no_grad():
            wave = self._load(self.folder / clip["path"])
            if self.train:
                wave = self._augment(wave)
            feats = self.features(wave)[: self.max_frames]  # [T, n_mels]
            if self.train:
                feats = self.spec_augment(feats.T.unsqueeze(0))[0].T
        return {
            "features": feats.contiguous(),
            "y": torch.tensor(clip["label"], dtype=torch.int32),
        }


class BucketCollate:
    """Pads a list of items to the smallest bucket that holds the longest, with a frame mask.

    A few buckets mean a few compiled shapes; items longer than the largest bucket must be
    cropped by the dataset (``max_frames``).

    Example:
        >>> items = [{"features": torch.ones(t, 4), "y": torch.tensor(1, dtype=torch.int32)}
        ...          for t in (10, 30)]
        >>> batch = BucketCollate((16, 32))(items)
        >>> batch["features"].shape, batch["frame_mask"].sum(1).tolist()
        (torch.Size([2, 32, 4]), [10, 30])
    """

    def __init__(self, buckets: Sequence[int] = (48, 64, 128)) -> None:
        if not buckets or sorted(buckets) != list(buckets) or min(buckets) < 1:
            raise SpokenDigitsDataError(
                f"buckets={list(buckets)}: expected increasing positive frame counts. "
                "Fix: set data.buckets, e.g. [48, 64, 128]."
            )
        self.buckets = tuple(int(b) for b in buckets)

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(item["features"].shape[0] for item in items)
        bucket = next((b for b in self.buckets if b >= longest), None)
        if bucket is None:
            raise SpokenDigitsDataError(
                f"An item has {longest} frames, more than the largest bucket "
                f"{self.buckets[-1]}. Fix: crop items (max_frames) or add a larger bucket."
            )
        n_mels = items[0]["features"].shape[1]
        features = torch.zeros(len(items), bucket, n_mels)
        frame_mask = torch.zeros(len(items), bucket, dtype=torch.bool)
        for row, item in enumerate(items):
            t = item["features"].shape[0]
            features[row, :t] = item["features"]
            frame_mask[row, :t] = True
        return {
            "features": features,
            "frame_mask": frame_mask,
            "y": torch.stack([item["y"] for item in items]),
        }


class SpokenDigitsDataModule(SplitDataModule):
    """Train/val/test splits by speaker of the spoken-digits set, built on first use.

    Args:
        root: cache folder of the generated set (``~/.cache/coreshell/spoken_digits`` when
            ``None``); never inside the repository.
        batch_size: training batch (``drop_last``: one compiled shape per bucket).
        eval_batch_size: validation/test batch.
        num_workers: DataLoader worker processes (``spawn``, persistent).
        takes: clips per (speaker, digit).
        speakers: use only the first N voices (tiny sets for tests); all when ``None``.
        val_fraction: share of speakers held out for validation.
        test_fraction: share of speakers held out for testing.
        split_seed: decides the speaker split and every clip's prosody.
        n_mels: mel bands.
        buckets: frame counts batches are padded to.
        augment: training augmentations on/off.
        seed: seeds the loaders' shuffling and the workers.

    Example:
        >>> import tempfile
        >>> dm = SpokenDigitsDataModule(tempfile.mkdtemp(), batch_size=8, num_workers=0,
        ...                             takes=1, speakers=3)
        >>> dm.prepare_data(); dm.setup("fit")
        >>> sorted(next(iter(dm.train_dataloader())))
        ['features', 'frame_mask', 'y']
    """

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 1,
        takes: int = 4,
        speakers: int | None = None,
        val_fraction: float = 0.12,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        n_mels: int = 40,
        buckets: Sequence[int] = (48, 64, 128),
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.root = Path(root).expanduser() if root else default_root()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.build_kwargs: dict[str, Any] = {
            "takes": takes,
            "speakers": speakers,
            "val_fraction": val_fraction,
            "test_fraction": test_fraction,
            "seed": split_seed,
        }
        self.n_mels = n_mels
        collate = BucketCollate(buckets)
        self.collate, self.buckets = collate, collate.buckets
        self.augment = augment
        self.seed = seed
        self.datasets: dict[str, SpokenDigitsDataset] = {}

    def prepare_data(self) -> None:
        ensure_spoken_digits(self.root, **self.build_kwargs)

    def setup(self, stage: str | None = None) -> None:
        folder = ensure_spoken_digits(self.root, **self.build_kwargs)  # verified: cheap
        max_frames = self.buckets[-1]
        self.datasets = {
            split: SpokenDigitsDataset(
                folder,
                split,
                train=split == "train" and self.augment,
                n_mels=self.n_mels,
                max_frames=max_frames,
            )
            for split in ("train", "val", "test")
        }
