"""Log-mel features of the spoken-digits recipe, as the DataLoader workers and the served
model compute them (torchaudio)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchaudio
from torch import nn

from torchshell.data._spoken_digits_build import SAMPLE_RATE

__all__ = ["LogMel"]


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

    def _power(self, wave: torch.Tensor) -> torch.Tensor:
        """Mel power ``[..., n_mels, T]`` of ``self.mel``, with ``|STFT|²`` as ``re² + im²``:
        the value of torchaudio's ``abs().pow(2)`` (the served twin's) to float rounding, 2.5x
        faster (that complex ``abs`` was a fifth of a training batch's front end)."""
        s = self.mel.spectrogram
        spec = torchaudio.functional.spectrogram(
            wave,
            pad=s.pad,
            window=s.window,
            n_fft=s.n_fft,
            hop_length=s.hop_length,
            win_length=s.win_length,
            power=None,
            normalized=s.normalized,
            center=s.center,
            pad_mode=s.pad_mode,
            onesided=s.onesided,
        )
        return self.mel.mel_scale(spec.real * spec.real + spec.imag * spec.imag)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # wave: [..., N] -> [..., T, n_mels]
        x = torch.log10(torch.clamp(self._power(wave), min=1e-10))
        peak = x.amax(dim=(-2, -1), keepdim=True)
        x = torch.maximum(x, peak - 8.0)
        return ((x + 4.0) / 4.0).transpose(-1, -2)

    def many(self, waves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Features of clips of different lengths in one call: ``[T_i, n_mels]`` each.

        Zero-padded to the longest; each clip keeps its own ``N // hop + 1`` frames and its
        own peak. Only a clip's last two frames can differ from :meth:`forward` on it alone
        (zeros past its end instead of the reflect padding).

        Example:
            >>> lm = LogMel()
            >>> [f.shape[0] for f in lm.many([torch.randn(16000), torch.randn(8000)])]
            [101, 51]
        """
        hop = self.mel.hop_length
        lengths = [int(w.shape[-1]) for w in waves]
        batch = torch.zeros(len(waves), max(lengths))
        for row, w in enumerate(waves):
            batch[row, : w.shape[-1]] = w
        x = torch.log10(torch.clamp(self._power(batch), min=1e-10)).transpose(-1, -2)  # [B, T, M]
        frames = torch.tensor([n // hop + 1 for n in lengths])
        valid = torch.arange(x.shape[1])[None] < frames[:, None]  # [B, T]
        peak = x.masked_fill(~valid[..., None], -torch.inf).amax(dim=(1, 2), keepdim=True)
        x = (torch.maximum(x, peak - 8.0) + 4.0) / 4.0
        return [x[row, : int(t)] for row, t in enumerate(frames)]
