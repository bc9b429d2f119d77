"""Training augmentation of the spoken-digits recipe, batched, in the DataLoader workers.

What a real recording has and a clean eSpeak NG clip lacks, each drawn per clip:

========================  ==========================================================
speed perturbation        resampled by a factor in ``speeds`` (0.9-1.1): tempo and
                          pitch together, as Kaldi's speed perturbation
gain                      uniform in ``[-gain_db, gain_db]``
time shift                leading silence up to ``max_lead_s``, trailing up to
                          ``max_trail_s``
noise                     white, pink or brown, at an SNR uniform in ``snr_db``
                          (10-30 dB, against the speech's own power), with
                          probability ``noise_p``
pitch / formant warp      the mel axis rescaled by a factor in ``1 +- mel_warp``
                          (VTLP-style, on the features)
SpecAugment               ``freq_masks`` masks of up to ``freq_mask`` bands and
                          ``time_masks`` masks of up to ``time_mask`` frames
========================  ==========================================================

Validation and test clips get none of it (the data set applies it only with ``train=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torchaudio

__all__ = ["Augment", "add_noise", "colored_noise", "speed_perturb", "warp_mel"]

#: Samples per row of :class:`Augment`'s noise bank (4.1 s at 16 kHz, the FFT length a batch's
#: own noise used to get), rows per noise colour, and noisy clips per row before a redraw.
BANK_SAMPLES, BANK_ROWS, BANK_USES = 1 << 16, 16, 32


def speed_perturb(wave: torch.Tensor, factor: float) -> torch.Tensor:
    """Plays ``wave`` ``factor`` times faster (shorter and higher for ``factor > 1``).

    The factor is rounded to a multiple of 0.05 so the resampling kernel stays small
    (``orig = 20 * factor``, ``new = 20``).

    Example:
        >>> speed_perturb(torch.zeros(2, 1150), 1.15).shape
        torch.Size([2, 1000])
    """
    orig = round(20 * factor)
    if orig == 20:
        return wave
    return torchaudio.functional.resample(wave, orig, 20)


def colored_noise(
    length: int,
    exponent: float | torch.Tensor,
    generator: torch.Generator | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """Unit-power noise with a ``1 / f**exponent`` power spectrum (0 white, 1 pink, 2 brown).

    ``rows`` noises at once (``exponent`` then one per row) are ``[rows, length]``. The FFT
    runs on the next power of two (an odd length can be ~10x slower), cropped.

    Example:
        >>> n = colored_noise(16000, 1.0, torch.Generator().manual_seed(0))
        >>> n.shape, round(float(n.pow(2).mean()), 3)
        (torch.Size([16000]), 1.0)
    """
    shape = (1 if rows is None else rows, 1 << max(length - 1, 1).bit_length())
    noise = torch.randn(shape, generator=generator)
    exp = torch.as_tensor(exponent, dtype=torch.float32).reshape(-1, 1)
    if bool((exp != 0).any()):
        spectrum = torch.fft.rfft(noise)
        freqs = torch.arange(spectrum.shape[-1], dtype=torch.float32).clamp(min=1.0)
        noise = torch.fft.irfft(spectrum / freqs[None] ** (exp / 2), n=shape[1])
    noise = noise[:, :length]
    noise = noise / noise.pow(2).mean(dim=1, keepdim=True).clamp(min=1e-20).sqrt()
    return noise[0] if rows is None else noise


def add_noise(
    wave: torch.Tensor,
    snr_db: float,
    *,
    exponent: float = 0.0,
    signal_power: float | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """``wave`` plus colored noise at ``snr_db`` dB below ``signal_power`` (the wave's own).

    ``noise`` (unit power, ``wave``'s length) replaces a fresh :func:`colored_noise`.

    Example:
        >>> w = torch.sin(torch.arange(16000) * 0.1)
        >>> noisy = add_noise(w, 20.0, generator=torch.Generator().manual_seed(0))
        >>> round(float(10 * torch.log10(w.pow(2).mean() / (noisy - w).pow(2).mean())))
        20
    """
    power = float(wave.pow(2).mean()) if signal_power is None else signal_power
    if noise is None:
        noise = colored_noise(wave.shape[-1], exponent, generator)
    return wave + noise * (max(power, 1e-10) / 10 ** (snr_db / 10)) ** 0.5


def warp_mel(features: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """Rescales the mel axis of ``features[..., T, n_mels]``: band ``m`` reads band ``m * factor``.

    A factor above 1 moves the spectrum down (a lower, shorter vocal tract's mirror image);
    bands read past the top repeat the top band. ``factor`` may hold one value per leading
    row (``[B]`` for ``[B, T, n_mels]``).

    Example:
        >>> f = torch.arange(4.0).expand(2, 4)
        >>> warp_mel(f, 0.5)[0].tolist()
        [0.0, 0.5, 1.0, 1.5]
    """
    n = features.shape[-1]
    a = torch.as_tensor(factor, dtype=torch.float32)
    a = a.reshape(a.shape + (1,) * (features.dim() - a.dim()))  # [B, 1, 1] or [1]*dim
    src = (torch.arange(n, dtype=torch.float32) * a).clamp(max=n - 1)
    lo = src.floor().long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = src - lo
    lo, hi = (i.expand(features.shape) for i in (lo, hi))
    return features.gather(-1, lo) * (1 - frac) + features.gather(-1, hi) * frac


@dataclass
class Augment:
    """The training augmentations, with their ranges (see the module's table).

    Example:
        >>> aug = Augment()
        >>> waves = [torch.randn(8000) * 0.1, torch.randn(4000) * 0.1]
        >>> out, drawn = aug.waves(waves, torch.Generator().manual_seed(0))
        >>> len(out), sorted(drawn[0])
        (2, ['exponent', 'gain_db', 'lead', 'snr_db', 'speed', 'trail'])
    """

    speeds: Sequence[float] = (0.9, 0.95, 1.0, 1.05, 1.1)
    gain_db: float = 6.0
    max_lead_s: float = 0.6
    max_trail_s: float = 0.1
    snr_db: Sequence[float] = (10.0, 30.0)
    noise_p: float = 0.7
    noise_exponents: Sequence[float] = (0.0, 1.0, 2.0)
    mel_warp: float = 0.06
    freq_masks: int = 2
    freq_mask: int = 6
    time_masks: int = 2
    time_mask: int = 6
    sample_rate: int = 16_000
    _bank: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _bank_uses: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from torchshell.data._spoken_digits_build import SpokenDigitsDataError

        lo, hi = self.snr_db
        if not self.speeds or min(self.speeds) <= 0 or lo > hi or not 0 <= self.noise_p <= 1:
            raise SpokenDigitsDataError(
                f"Augment(speeds={list(self.speeds)}, snr_db={list(self.snr_db)}, "
                f"noise_p={self.noise_p}): expected positive speeds, snr_db as [low, high] "
                "and noise_p in [0, 1]. Fix: set data.augment_options accordingly."
            )

    def waves(
        self, waves: Sequence[torch.Tensor], generator: torch.Generator | None = None
    ) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
        """Augments each 1-D waveform; returns the new waves and what was drawn for each."""
        g = generator

        def uniform(a: float, b: float) -> float:
            return a + (b - a) * float(torch.rand((), generator=g))

        drawn = []
        for _ in waves:
            speed = self.speeds[int(torch.randint(len(self.speeds), (), generator=g))]
            noisy = float(torch.rand((), generator=g)) < self.noise_p
            drawn.append(
                {
                    "speed": float(speed),
                    "gain_db": uniform(-self.gain_db, self.gain_db),
                    "lead": int(uniform(0, self.max_lead_s) * self.sample_rate),
                    "trail": int(uniform(0, self.max_trail_s) * self.sample_rate),
                    "snr_db": uniform(*self.snr_db) if noisy else float("inf"),
                    "exponent": float(
                        self.noise_exponents[
                            int(torch.randint(len(self.noise_exponents), (), generator=g))
                        ]
                    ),
                }
            )
        out: list[torch.Tensor] = list(waves)
        # one resampling call per speed: each group shares a kernel (batched, ~10x cheaper)
        for speed in {d["speed"] for d in drawn}:
            rows = [i for i, d in enumerate(drawn) if d["speed"] == speed]
            longest = max(waves[i].shape[0] for i in rows)
            batch = torch.zeros(len(rows), longest)
            for r, i in enumerate(rows):
                batch[r, : waves[i].shape[0]] = waves[i]
            fast = speed_perturb(batch, speed)
            for r, i in enumerate(rows):
                out[i] = fast[r, : max(1, round(waves[i].shape[0] / speed))]
        for i, d in enumerate(drawn):
            wave = out[i] * 10 ** (d["gain_db"] / 20)
            power = float(wave.pow(2).mean())
            wave = torch.nn.functional.pad(wave, (int(d["lead"]), int(d["trail"])))
            if d["snr_db"] != float("inf"):
                noise = self._noise(wave.shape[0], d["exponent"], g)
                noise = noise / noise.pow(2).mean().clamp(min=1e-20).sqrt()
                wave = add_noise(wave, d["snr_db"], signal_power=power, noise=noise)
            out[i] = wave
        return out, drawn

    def _noise(
        self, length: int, exponent: float, generator: torch.Generator | None
    ) -> torch.Tensor:
        """``length`` samples of one colour's noise: a random stretch of a row of the bank.

        The bank (:data:`BANK_ROWS` rows of :data:`BANK_SAMPLES` per exponent, one FFT call)
        is drawn again after ``BANK_USES * BANK_ROWS`` noisy clips (:data:`BANK_USES` per row
        on average): the FFT of every clip's own noise was a third of a batch's augmentation
        time. Longer clips get their own.
        """
        if length > BANK_SAMPLES:
            return colored_noise(length, exponent, generator)
        if self._bank is None or self._bank_uses >= BANK_USES * BANK_ROWS:
            exps = torch.tensor(self.noise_exponents, dtype=torch.float32)
            rows = exps.repeat_interleave(BANK_ROWS)
            self._bank = colored_noise(BANK_SAMPLES, rows, generator, rows=len(rows))
            self._bank_uses = 0
        self._bank_uses += 1
        kind = list(self.noise_exponents).index(exponent)
        row = kind * BANK_ROWS + int(torch.randint(BANK_ROWS, (), generator=generator))
        start = int(torch.randint(BANK_SAMPLES - length + 1, (), generator=generator))
        return self._bank[row, start : start + length]

    def features(
        self, features: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Mel warp and SpecAugment masks on ``features[B, T, n_mels]`` (new tensor)."""
        g = generator
        factors = 1 + self.mel_warp * (2 * torch.rand(features.shape[0], generator=g) - 1)
        out = warp_mel(features, factors)
        b, t, m = out.shape
        for count, width, size, axis in (
            (self.freq_masks, self.freq_mask, m, 2),
            (self.time_masks, self.time_mask, t, 1),
        ):
            for _ in range(count):
                w = (torch.rand(b, generator=g) * (width + 1)).long().clamp(max=size)
                start = (torch.rand(b, generator=g) * (size - w + 1)).long()
                pos = torch.arange(size)[None]
                hit = (pos >= start[:, None]) & (pos < (start + w)[:, None])  # [B, size]
                out = out.masked_fill(hit[:, None, :] if axis == 2 else hit[:, :, None], 0.0)
        return out
