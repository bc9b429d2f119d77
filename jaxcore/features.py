"""Speech features inside the jitted step: log-mel and silence trimming of raw waveforms.

Pure JAX twins of the spoken-digits front end that DataLoader workers run with torchaudio
(``torchshell.data._features.LogMel``, ``torchshell.data._spoken_digits_trim``), so a
GPU computes them next to the model instead of the host's workers. Every shape is static:
a batch of clips is zero-padded to ``waveform[B, N]`` with their true ``lengths[B]``; each
clip keeps its own ``N_i // hop + 1`` frames and its own peak.

torchaudio's ``MelSpectrogram`` as ``LogMel`` builds it: a periodic Hann window of
``n_fft`` samples, ``center=True`` with reflect padding, ``|STFT|^2``, an HTK mel filterbank
from 0 Hz to ``sample_rate / 2`` with no area normalisation; then ``log10`` of the power
clamped at 1e-10, an 8-decade floor under the clip's peak and ``(x + 4) / 4``.

Where the reflect padding at the end happens, ``reflect``:

* ``"clip"``: at each clip's own end, what ``LogMel`` gives a clip alone (the data set's
  evaluation items, the served model);
* ``"batch"``: at the longest clip's end, zeros past every other clip, what ``LogMel.many``
  gives a training batch.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore._errors import ConfigError

__all__ = ["log_mel", "mel_filterbank", "trim_silence", "warp_mel"]

_FAR = 1 << 30  # pushes unvoiced frames out of the first/last reductions


def mel_filterbank(
    n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0, f_max: float | None = None
) -> np.ndarray:
    """torchaudio's ``melscale_fbanks`` (HTK scale, ``norm=None``): ``float32[n_freqs, n_mels]``.

    Computed in float32 in torchaudio's order, so the matrix equals torchaudio's.

    Example:
        >>> mel_filterbank(201, 40, 16000).shape
        (201, 40)
    """
    f_max = sample_rate / 2 if f_max is None else f_max
    all_freqs = np.linspace(0, sample_rate // 2, n_freqs, dtype=np.float32)
    m_min, m_max = (2595.0 * math.log10(1.0 + f / 700.0) for f in (f_min, f_max))
    m_pts = np.linspace(m_min, m_max, n_mels + 2, dtype=np.float32)
    f_pts = (700.0 * (np.float32(10.0) ** (m_pts / np.float32(2595.0)) - 1.0)).astype(np.float32)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts[None, :] - all_freqs[:, None]
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    return np.maximum(0.0, np.minimum(down, up)).astype(np.float32)


def _hann(n: int) -> np.ndarray:
    """``torch.hann_window(n)`` (periodic)."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)


@partial(jax.jit, static_argnames=("sample_rate", "n_mels", "n_fft", "hop_length", "reflect"))
def log_mel(
    waveform: jax.Array,
    lengths: jax.Array,
    *,
    sample_rate: int = 16_000,
    n_mels: int = 40,
    n_fft: int = 400,
    hop_length: int = 160,
    reflect: str = "clip",
) -> tuple[jax.Array, jax.Array]:
    """Normalised log-mel frames of a zero-padded batch of clips, with their frame mask.

    Args:
        waveform: ``float[B, N]`` mono clips, each zero-padded past its length.
        lengths: ``int[B]`` samples of each clip (at least 1).
        sample_rate: of the waveform.
        n_mels: mel bands.
        n_fft: FFT size (and window length).
        hop_length: frame step.
        reflect: ``"clip"`` or ``"batch"`` (see the module's docstring).

    Returns:
        ``(features float32[B, N // hop + 1, n_mels], frame_mask bool[B, N // hop + 1])``:
        clip ``i``'s ``lengths[i] // hop + 1`` frames first, zeros after them.

    Example:
        >>> feats, mask = log_mel(jnp.ones((2, 16000)), jnp.array([16000, 8000]))
        >>> feats.shape, mask.sum(1).tolist()
        ((2, 101, 40), [101, 51])
    """
    if reflect not in ("clip", "batch"):
        raise ConfigError(f"reflect={reflect!r}: expected 'clip' or 'batch'. Fix: pass one.")
    n = waveform.shape[1]
    lengths = jnp.asarray(lengths, jnp.int32)
    samples = jnp.arange(n)
    wave = jnp.where(samples[None] < lengths[:, None], waveform.astype(jnp.float32), 0.0)
    pad = n_fft // 2
    end = lengths if reflect == "clip" else jnp.full_like(lengths, jnp.max(lengths))
    last = (end - 1)[:, None]
    # center=True with reflect padding: index -i reads i, index last + i reads last - i
    idx = jnp.abs(jnp.arange(n + 2 * pad) - pad)[None]
    idx = jnp.where(idx > last, 2 * last - idx, idx)
    padded = jnp.take_along_axis(wave, jnp.clip(idx, 0, last), axis=1)  # [B, N + n_fft]
    frames = n // hop_length + 1
    starts = jnp.arange(frames) * hop_length
    windows = padded[:, starts[:, None] + jnp.arange(n_fft)[None]]  # [B, T, n_fft]
    spec = jnp.fft.rfft(windows * jnp.asarray(_hann(n_fft)), axis=-1)
    power = spec.real * spec.real + spec.imag * spec.imag  # [B, T, n_fft // 2 + 1]
    fb = jnp.asarray(mel_filterbank(n_fft // 2 + 1, n_mels, sample_rate))
    mel = jnp.matmul(power, fb, precision=jax.lax.Precision.HIGHEST)  # [B, T, n_mels]
    x = jnp.log10(jnp.maximum(mel, 1e-10))
    frame_mask = jnp.arange(frames)[None] <= (lengths // hop_length)[:, None]
    peak = jnp.max(jnp.where(frame_mask[..., None], x, -jnp.inf), axis=(1, 2), keepdims=True)
    x = (jnp.maximum(x, peak - 8.0) + 4.0) / 4.0
    return x * frame_mask[..., None], frame_mask


@partial(jax.jit, static_argnames=("margin_db", "floor_ratio", "pad", "min_frames"))
def trim_silence(
    features: jax.Array,
    frame_mask: jax.Array,
    *,
    margin_db: float = 40.0,
    floor_ratio: float = 0.3,
    pad: int = 8,
    min_frames: int = 8,
) -> tuple[jax.Array, jax.Array]:
    """Moves each clip's voiced span to frame 0 and shortens its mask; shapes unchanged.

    The same reductions and gather as ``torchshell.data.spoken_digits.trim_silence`` (see
    its docstring and ``docs/speech.md``): a frame is voiced when its mean log mel power in
    dB is above ``max(peak - margin_db, floor + floor_ratio * (peak - floor))``; ``pad``
    frames are kept on each side, at least ``min_frames`` (or the whole clip).

    Example:
        >>> x = jnp.zeros((1, 100, 40)).at[0, 60:80].set(1.0)
        >>> feats, mask = trim_silence(x, jnp.ones((1, 100), bool))
        >>> int(mask.sum()), float(feats[0, :8, 0].sum()), float(feats[0, 8:28].min())
        (36, 0.0, 1.0)
    """
    mask = frame_mask.astype(bool)
    t = jnp.arange(features.shape[1])
    energy = features.mean(axis=-1) * 40.0  # mean log mel power in dB
    peak = jnp.max(jnp.where(mask, energy, -jnp.inf), axis=1, keepdims=True)
    floor = jnp.min(jnp.where(mask, energy, jnp.inf), axis=1, keepdims=True)
    threshold = jnp.maximum(peak - margin_db, floor + floor_ratio * (peak - floor))
    off = (~((energy >= threshold) & mask)).astype(jnp.int32) * _FAR
    first = jnp.min(t[None] + off, axis=1)
    last = jnp.max(t[None] - off, axis=1)
    n = mask.astype(jnp.int32).sum(axis=1)
    start = jnp.maximum(first - pad, 0)
    end = jnp.minimum(last + pad + 1, n)
    end = jnp.maximum(end, jnp.minimum(start + min_frames, n))
    start = jnp.minimum(start, jnp.maximum(end - min_frames, 0))
    idx = jnp.minimum(t[None] + start[:, None], jnp.maximum(n - 1, 0)[:, None])  # [B, T]
    kept = jnp.take_along_axis(features, idx[..., None], axis=1)
    new_mask = t[None] < (end - start)[:, None]
    return kept * new_mask[..., None].astype(kept.dtype), new_mask


@jax.jit
def warp_mel(features: jax.Array, factor: jax.Array) -> jax.Array:
    """Rescales the mel axis of ``features[B, T, n_mels]``: band ``m`` reads ``m * factor[b]``.

    ``torchshell.data._augment.warp_mel`` in JAX (bands read past the top repeat the top).

    Example:
        >>> warp_mel(jnp.arange(4.0)[None, None], jnp.array([0.5]))[0, 0].tolist()
        [0.0, 0.5, 1.0, 1.5]
    """
    m = features.shape[-1]
    src = jnp.minimum(jnp.arange(m, dtype=jnp.float32)[None] * factor[:, None], m - 1)  # [B, M]
    lo = jnp.floor(src).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, m - 1)
    frac = (src - lo)[:, None, :]
    pick = jax.vmap(lambda f, i: f[:, i])  # row b's frames at its band indices
    return pick(features, lo) * (1 - frac) + pick(features, hi) * frac
