"""Torch twin of :class:`jaxcore.models.spoken_digits.SpokenDigitsEncoder`, and its serving model.

Standard layers with the Flax model's names (``stem.0``, ``blocks.0.attn.q``, ``norm``,
``head``), so ``bridge.export_state_dict(params, twin)`` fills it strictly with no custom
rule. :class:`SpokenDigitsServing` wraps the twin with the torchaudio front-end, so the
exported model takes a raw waveform and returns digit logits.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from torchshell.data.spoken_digits import SAMPLE_RATE, LogMel, trim_silence


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's sinusoidal position table ``[length, channels]`` (same as the Flax model's)."""
    inc = math.log(10_000) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class Attention(nn.Module):
    """Multi-head self-attention with a key mask; projections ``q``, ``k``, ``v``, ``out``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)

        bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(
            split(self.q), split(self.k), split(self.v), attn_mask=bias[:, None, None, :]
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: masked attention then a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width * mlp_ratio)
        self.fc2 = nn.Linear(width * mlp_ratio, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class SpokenDigitsEncoder(nn.Module):
    """Whisper-style encoder over log-mel frames; the Flax model's export target.

    Args:
        n_mels: mel bands of the input features.
        width: model width.
        depth: transformer blocks.
        heads: attention heads.
        mlp_ratio: MLP hidden width over ``width``.
        num_classes: output logits.
        dropout: residual dropout in training.

    Example:
        >>> twin = SpokenDigitsEncoder(width=32, depth=1, heads=2).eval()
        >>> twin(*twin.example_input()).shape
        torch.Size([2, 10])
    """

    # torch.export / ONNX: batch and time are dynamic (the two inputs share the time axis);
    # the stride-2 stem needs 3 frames; the ONNX check runs 0.2 s, 0.64 s and 5 s of frames
    dynamic_axes = ({0: "batch", 1: "frames"}, {0: "batch", 1: "frames"})
    dim_min: ClassVar[dict[str, int]] = {"frames": 3}
    check_lengths = (21, 64, 501)

    def __init__(
        self,
        n_mels: int = 40,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.width = width
        self.stem = nn.ModuleList(
            [
                nn.Conv1d(n_mels, width, 3, stride=1, padding=1),
                nn.Conv1d(width, width, 3, stride=2, padding=1),
            ]
        )
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, features: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        # features: [B, T, n_mels], frame_mask: [B, T] -> logits [B, num_classes]
        mask = frame_mask.to(torch.bool)
        x = (features * mask[..., None].to(features.dtype)).transpose(1, 2)  # [B, n_mels, T]
        x = F.gelu(self.stem[0](x)) * mask[:, None, :].to(x.dtype)  # padded frames stay zero
        x = F.gelu(self.stem[1](x)).transpose(1, 2)  # [B, T/2, width]
        # mask[:, ::2], as a stride-2 conv picking frame 2t: its length is the stem's,
        # symbolically too (torch.export keeps the time axis dynamic)
        pick = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=x.dtype)
        mask = F.conv1d(mask[:, None, :].to(x.dtype), pick, stride=2, padding=1)[:, 0] > 0.5
        x = x + sinusoids(x.shape[1], self.width).to(x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        m = mask[..., None].to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp(min=1.0))

    def serving(self) -> SpokenDigitsServing:
        """The deployable module: this twin behind the torchaudio front-end (raw waveform in)."""
        return SpokenDigitsServing(self).eval()

    def example_input(self, batch: int = 2, frames: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample ``(features[B, T, n_mels], frame_mask[B, T])`` for tracing and export."""
        features = torch.randn(
            batch, frames, self.n_mels, generator=torch.Generator().manual_seed(0)
        )
        frame_mask = torch.ones(batch, frames, dtype=torch.bool)
        frame_mask[1:, frames // 2 :] = False
        return features, frame_mask


class SpokenDigitsServing(nn.Module):
    """Raw waveforms of any length in, digit logits out: the torchaudio front-end, then the twin.

    A batch holds clips of different lengths padded to the longest (``waveform[B, N]``) and
    their true lengths (``lengths[B]``, in samples). Each clip's features are exactly what
    :class:`~torchshell.data.spoken_digits.LogMel` gives that clip alone (the reflect padding
    at each clip's own end, the peak normalisation over its own frames), so padding never
    changes a clip's logits; then each clip's silence is trimmed
    (:func:`~torchshell.data.spoken_digits.trim_silence`: its voiced span moved to frame 0, as
    the data set trims every training and test item); both axes stay dynamic under
    ``torch.export``.

    Args:
        encoder: the trained twin.
        sample_rate: of the incoming waveform; resampled to 16 kHz when different.

    Example:
        >>> serving = SpokenDigitsServing(SpokenDigitsEncoder(width=32, depth=1, heads=2)).eval()
        >>> waveform, lengths = serving.example_input()
        >>> waveform.shape, lengths.tolist(), serving(waveform, lengths).shape
        (torch.Size([2, 8000]), [8000, 4800], torch.Size([2, 10]))
    """

    input_names = ("waveform", "lengths")
    dynamic_axes = ({0: "batch", 1: "samples"}, {0: "batch"})
    # a clip must be longer than the reflect padding (n_fft / 2)
    dim_min: ClassVar[dict[str, int]] = {"samples": 401}

    def __init__(self, encoder: SpokenDigitsEncoder, sample_rate: int = SAMPLE_RATE) -> None:
        super().__init__()
        import torchaudio

        self.sample_rate = sample_rate
        self.resample = (
            torchaudio.transforms.Resample(sample_rate, SAMPLE_RATE)
            if sample_rate != SAMPLE_RATE
            else nn.Identity()
        )
        self.front_end = LogMel(n_mels=encoder.n_mels)
        self.encoder = encoder

    def features(
        self, waveform: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features[B, T, n_mels], frame_mask[B, T])`` of a padded batch of 16 kHz clips:
        what the encoder (torch or JAX) is fed, :meth:`log_mel` with its silence trimmed."""
        return trim_silence(*self.log_mel(waveform, lengths))

    def log_mel(
        self, waveform: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each clip's :class:`~torchshell.data.spoken_digits.LogMel` frames, padded, with
        their mask (no trimming)."""
        import torchaudio

        mel = self.front_end.mel
        spec = mel.spectrogram
        pad = spec.n_fft // 2
        # every clip reflect-padded at its own ends (torch.stft's center=True, clip by clip)
        idx = (torch.arange(waveform.shape[1] + 2 * pad, device=waveform.device) - pad).abs()
        last = (lengths.to(torch.int64) - 1)[:, None]
        idx = torch.where(idx[None] > last, 2 * last - idx[None], idx[None])
        padded = waveform.gather(1, torch.minimum(idx.clamp(min=0), last))
        power = torchaudio.functional.spectrogram(
            padded,
            pad=0,
            window=spec.window,
            n_fft=spec.n_fft,
            hop_length=spec.hop_length,
            win_length=spec.win_length,
            power=spec.power,
            normalized=spec.normalized,
            center=False,
        )
        x = torch.log10(torch.clamp(mel.mel_scale(power), min=1e-10))  # [B, n_mels, T]
        frames = torch.arange(x.shape[-1], device=x.device)
        frame_mask = frames[None] <= (lengths.to(torch.int64) // spec.hop_length)[:, None]
        peak = x.masked_fill(~frame_mask[:, None, :], -math.inf).amax(dim=(-2, -1), keepdim=True)
        x = torch.maximum(x, peak - 8.0)
        features = ((x + 4.0) / 4.0).transpose(-1, -2) * frame_mask[..., None].to(x.dtype)
        return features, frame_mask

    def forward(self, waveform: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        # waveform: float32 [B, N] (or [N]) mono, lengths: int [B] samples -> logits [B, C]
        if waveform.dim() == 1:
            waveform = waveform[None]
        if lengths is None:
            lengths = torch.full(waveform.shape[:1], waveform.shape[1], dtype=torch.int64)
        if self.sample_rate != SAMPLE_RATE:
            waveform = self.resample(waveform)
            lengths = torch.ceil(lengths * (SAMPLE_RATE / self.sample_rate)).to(torch.int64)
        return self.encoder(*self.features(waveform, lengths))

    def example_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample batch of two clips of 0.5 s and 0.3 s at 16 kHz: ``(waveform[2, 8000],
        lengths[2])``; the second is zero-padded."""
        t = torch.arange(8000, dtype=torch.float32) / SAMPLE_RATE
        wave = (0.1 * torch.sin(2 * math.pi * 220.0 * t))[None].repeat(2, 1)
        wave[1, 4800:] = 0.0
        return wave, torch.tensor([8000, 4800], dtype=torch.int64)
