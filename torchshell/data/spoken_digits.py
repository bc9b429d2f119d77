"""The spoken-digits recipe's data: eSpeak NG voices, torchaudio features in DataLoader workers.

WAVs (16 kHz mono, built offline by :func:`ensure_spoken_digits`) are read in the workers,
resampled where needed, augmented for training (speed perturbation, gain, leading/trailing
silence, colored noise at 10-30 dB SNR; then a mel warp and SpecAugment masks on the features:
see :mod:`torchshell.data._augment`), turned into a log-mel spectrogram, their silence
trimmed (:func:`trim_silence`, as the served model does) and collated into a few length
buckets with a frame mask:
``{"features": float32[B, T, n_mels], "frame_mask": bool[B, T], "y": int32[B]}``.
A training batch is fetched whole (``__getitems__``): one resampling call per speed and one
mel spectrogram per batch, ~4x cheaper per clip than clip by clip.

With ``front_end="device"`` (:mod:`torchshell.data._front_end`) the workers stop at the
augmented waveform: ``{"waveform": float32[B, N], "lengths": int32[B], "y": int32[B]}``, and
the model computes the same features inside the jitted step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
import torchaudio
from torch import nn
from torch.utils.data import Dataset

from torchshell.data._augment import Augment
from torchshell.data._features import LogMel
from torchshell.data._front_end import WaveCollate, resolve_front_end
from torchshell.data._module import SplitDataModule
from torchshell.data._spoken_digits_build import (
    DIGITS,
    SAMPLE_RATE,
    SpokenDigitsDataError,
    default_root,
    ensure_spoken_digits,
    load_manifest,
)
from torchshell.data._spoken_digits_trim import trim_clips, trim_silence

__all__ = [
    "DIGITS",
    "SAMPLE_RATE",
    "Augment",
    "BucketCollate",
    "LogMel",
    "SpokenDigitsDataError",
    "SpokenDigitsDataModule",
    "SpokenDigitsDataset",
    "WaveCollate",
    "default_root",
    "ensure_spoken_digits",
    "trim_clips",
    "trim_silence",
]


class SpokenDigitsDataset(Dataset[dict[str, torch.Tensor]]):
    """One split of a built set as ``{"features": float32[T, n_mels], "y": int32}``.

    Training items are augmented (:class:`~torchshell.data._augment.Augment`); validation
    and test items are exactly :class:`LogMel` of the clip, as the served model computes it.
    Every item's silence is trimmed (:func:`trim_silence`: the voiced span first), as the
    served model trims it.

    Args:
        folder: a folder made by :func:`ensure_spoken_digits`.
        split: ``train``, ``val`` or ``test``.
        train: apply the training augmentations.
        n_mels: mel bands.
        max_frames: longer clips are cropped to this many frames.
        augment: the augmentation ranges (the defaults of ``Augment`` when ``None``).
        front_end: ``host`` (the items above) or ``device``: items are
            ``{"waveform": float32[N], "y": int32}``, augmented in training (the waveform
            augmentations only), the features left to the model.

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
        max_frames: int = 160,
        augment: Augment | None = None,
        front_end: str = "host",
    ) -> None:
        if split not in ("train", "val", "test"):
            raise SpokenDigitsDataError(
                f"split={split!r}: expected 'train', 'val' or 'test'. Fix: pass one of them."
            )
        self.folder = Path(folder)
        self.clips = [c for c in load_manifest(folder)["clips"] if c["split"] == split]
        self.train = train
        self.max_frames = max_frames
        self.augment = augment if augment is not None else Augment()
        self.front_end = resolve_front_end(front_end)
        self.features = LogMel(n_mels=n_mels)
        self._resamplers: dict[int, nn.Module] = {}
        self._waves: dict[int, torch.Tensor] = {}

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

    def wave(self, i: int) -> torch.Tensor:
        """Clip ``i``'s 16 kHz waveform as stored (no augmentation).

        A training set keeps each decoded clip (~120 MB for the default set's 4,440 clips,
        per worker): reading and decoding was a seventh of a training batch's time.
        """
        if i in self._waves:
            return self._waves[i]
        wave = self._load(self.folder / self.clips[i]["path"])
        if self.train:
            self._waves[i] = wave
        return wave

    def _item(self, feats: torch.Tensor, i: int) -> dict[str, torch.Tensor]:
        return {
            "features": feats[: self.max_frames].contiguous(),
            "y": torch.tensor(self.clips[i]["label"], dtype=torch.int32),
        }

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """A whole batch of items (the DataLoader's batched fetch): augmented in one go."""
        if not self.train:
            return [self[i] for i in indices]
        with torch.no_grad():
            waves, _ = self.augment.waves([self.wave(i) for i in indices])
            if self.front_end == "device":  # log-mel, trim, crop, warp, masks: in the step
                return [
                    {"waveform": w, "y": torch.tensor(self.clips[i]["label"], dtype=torch.int32)}
                    for w, i in zip(waves, indices, strict=True)
                ]
            # silence trimmed after the waveform augmentation, before the crop and SpecAugment
            feats = [f[: self.max_frames] for f in trim_clips(self.features.many(waves))]
            lengths = [f.shape[0] for f in feats]
            padded = torch.zeros(len(feats), max(lengths), feats[0].shape[1])
            for row, f in enumerate(feats):
                padded[row, : f.shape[0]] = f
            padded = self.augment.features(padded)
        return [
            self._item(padded[r, :t], i)
            for r, (t, i) in enumerate(zip(lengths, indices, strict=True))
        ]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.train:
            return self.__getitems__([i])[0]
        if self.front_end == "device":
            return {
                "waveform": self.wave(i),
                "y": torch.tensor(self.clips[i]["label"], dtype=torch.int32),
            }
        return self.host_item(i)

    def host_item(self, i: int) -> dict[str, torch.Tensor]:
        """Clip ``i`` as the host front end gives it unaugmented: its trimmed log-mel frames."""
        with torch.no_grad():
            return self._item(trim_clips([self.features(self.wave(i))])[0], i)


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
        buckets: frame counts batches are padded to; evaluation clips are cropped to the last.
        train_frames: training clips (augmented, silence trimmed) are cropped to this many
            frames, the last bucket when ``None``. A few clips in a thousand are longer than
            96 frames (by their trailing margin); each would pad its whole batch to the next
            bucket.
        augment: training augmentations on/off.
        augment_options: ranges of the augmentations (keyword arguments of
            :class:`~torchshell.data._augment.Augment`), its defaults when ``None``.
        min_test_clips: refuse a whole set (``speakers=None``) whose test split has fewer
            clips: a test accuracy over fewer clips moves by chance. Sets of a few
            ``speakers`` (tests) are not held to it.
        seed: seeds the loaders' shuffling and the workers.
        front_end: where the features are computed: ``host`` (the workers, torchaudio),
            ``device`` (the model, in the jitted step: batches of
            ``{"waveform", "lengths", "y"}``) or ``auto`` (``device`` on an accelerator); see
            :mod:`torchshell.data._front_end`.
        wave_buckets: sample counts waveform batches are padded to (``front_end=device``).

    Example:
        >>> import tempfile
        >>> dm = SpokenDigitsDataModule(tempfile.mkdtemp(), batch_size=8, num_workers=0,
        ...                             takes=1, speakers=3)
        >>> dm.prepare_data(); dm.setup("fit")
        >>> sorted(next(iter(dm.train_dataloader())))
        ['features', 'frame_mask', 'y']
        >>> sorted(dm.test_clip(0))  # for the run page's misclassified clips
        ['description', 'features', 'rate', 'wave']
    """

    class_names = DIGITS

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 1,
        takes: int = 6,
        speakers: int | None = None,
        val_fraction: float = 0.08,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        n_mels: int = 40,
        buckets: Sequence[int] = (64, 96, 160),
        train_frames: int | None = None,
        augment: bool = True,
        augment_options: Mapping[str, Any] | None = None,
        min_test_clips: int = 0,
        seed: int = 0,
        front_end: str = "host",
        wave_buckets: Sequence[int] = (16_000, 24_000, 32_000),
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
        if train_frames is not None and not 0 < train_frames <= self.buckets[-1]:
            raise SpokenDigitsDataError(
                f"train_frames={train_frames}: expected 1 to the largest bucket "
                f"{self.buckets[-1]}. Fix: set data.train_frames in that range, or null."
            )
        self.train_frames = train_frames or self.buckets[-1]
        self.frame_buckets = self.buckets
        self.front_end = resolve_front_end(front_end)
        if self.front_end == "device":  # batches are padded waveforms: their buckets are samples
            self.collate = WaveCollate(wave_buckets)
            self.buckets = self.collate.buckets
        self.augment = augment
        try:
            self.augment_options = Augment(**dict(augment_options or {}))
        except TypeError as err:
            raise SpokenDigitsDataError(
                f"data.augment_options={dict(augment_options or {})}: {err}. Fix: use the "
                "fields of torchshell.data.spoken_digits.Augment (speeds, snr_db, ...)."
            ) from err
        self.min_test_clips = min_test_clips
        self.seed = seed
        self.datasets: dict[str, SpokenDigitsDataset] = {}

    def prepare_data(self) -> None:
        self._folder = ensure_spoken_digits(self.root, **self.build_kwargs)

    def setup(self, stage: str | None = None) -> None:
        # verified by prepare_data in this process (checksums of every clip: seconds), else now
        folder = getattr(self, "_folder", None) or ensure_spoken_digits(
            self.root, **self.build_kwargs
        )
        self._folder = folder
        self.datasets = {
            split: SpokenDigitsDataset(
                folder,
                split,
                train=split == "train" and self.augment,
                n_mels=self.n_mels,
                max_frames=self.train_frames if split == "train" else self.frame_buckets[-1],
                augment=self.augment_options,
                front_end=self.front_end,
            )
            for split in ("train", "val", "test")
        }
        test = self.datasets["test"]
        if self.build_kwargs["speakers"] is None and len(test) < self.min_test_clips:
            raise SpokenDigitsDataError(
                f"The test split has {len(test)} clips, fewer than data.min_test_clips="
                f"{self.min_test_clips}. Fix: raise data.takes or data.test_fraction."
            )
        train_voices = {c["speaker"] for c in self.datasets["train"].clips}
        if train_voices & {c["speaker"] for c in test.clips}:
            raise SpokenDigitsDataError(
                "Test voices also appear in training: expected speaker-disjoint splits. "
                "Fix: rebuild the set (delete its folder under data.root)."
            )

    def test_clip(self, i: int) -> dict[str, Any]:
        """Test clip ``i`` (the test loader's order) for the run page: its waveform, rate,
        features and who says what (see the class example).
        """
        test = self.datasets["test"]
        clip = test.clips[i]
        return {
            "wave": test.wave(i).numpy(),
            "rate": SAMPLE_RATE,
            "features": test.host_item(i)["features"].numpy(),
            "description": f"'{clip['word']}' by {clip['voice']}",
        }
