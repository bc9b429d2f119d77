"""The spoken-digits encoder fed raw waveforms: the speech front end inside the jitted step.

:class:`SpokenDigitsWaveformEncoder` is :class:`~jaxcore.models.spoken_digits.SpokenDigitsEncoder`
(the same parameters, names and torch twin) behind the pure JAX front end of
:mod:`jaxcore.features`: log-mel, silence trimming, the crop, and in training the feature
augmentations that the host path runs in its DataLoader workers (mel warp, SpecAugment), drawn
from the step's ``dropout`` rng. The workers only decode, augment the waveform and pad it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcore import features as fe
from jaxcore.models.spoken_digits import SpokenDigitsEncoder


class SpokenDigitsWaveformEncoder(SpokenDigitsEncoder):
    """:class:`SpokenDigitsEncoder` over ``(waveform[B, N], lengths[B])``.

    Training batches get ``LogMel.many``'s features (reflect padding at the batch's longest
    clip), evaluation batches each clip's own (``LogMel`` of the clip alone, as the served
    model); both trimmed, then cropped to ``train_frames`` / ``eval_frames``, as the host
    path's data set crops.

    Attributes:
        n_mels: mel bands.
        train_frames: training clips keep at most this many frames after trimming.
        eval_frames: evaluation clips keep at most this many.
        augment: apply the feature augmentations below in training.
        mel_warp: training mel-axis warp, a factor in ``1 +- mel_warp`` per clip (0: off).
        freq_masks: SpecAugment band masks per training clip, each up to ``freq_mask`` bands.
        freq_mask: widest band mask.
        time_masks: SpecAugment frame masks per training clip, each up to ``time_mask``.
        time_mask: widest frame mask.

    Example:
        >>> m = SpokenDigitsWaveformEncoder(width=32, depth=1, heads=2)
        >>> wave, lengths = jnp.ones((2, 8000)), jnp.array([8000, 4000])
        >>> v = m.init(jax.random.key(0), wave, lengths)
        >>> m.apply(v, wave, lengths).shape
        (2, 10)
    """

    n_mels: int = 40
    train_frames: int = 80
    eval_frames: int = 160
    augment: bool = True
    mel_warp: float = 0.0
    freq_masks: int = 0
    freq_mask: int = 6
    time_masks: int = 0
    time_mask: int = 6

    def __call__(  # type: ignore[override]
        self, waveform: jax.Array, lengths: jax.Array, train: bool = False
    ) -> jax.Array:  # waveform: [B, N], lengths: [B] samples -> [B, num_classes]
        features, mask = self.features(waveform, lengths, train)
        if train and self.augment and (self.mel_warp > 0 or self.freq_masks or self.time_masks):
            features = self._augment(features, mask, self.make_rng("dropout"))
        return super().__call__(features, mask, train)

    def features(
        self, waveform: jax.Array, lengths: jax.Array, train: bool = False
    ) -> tuple[jax.Array, jax.Array]:
        """``(features[B, T, n_mels], frame_mask[B, T])`` the encoder is fed (no augmentation):
        log-mel, trimmed, cropped to ``train_frames`` or ``eval_frames``."""
        feats, mask = fe.log_mel(
            waveform, lengths, n_mels=self.n_mels, reflect="batch" if train else "clip"
        )
        feats, mask = fe.trim_silence(feats, mask)
        keep = self.train_frames if train else self.eval_frames
        if feats.shape[1] < keep:  # padded frames are masked: the logits do not change
            extra = keep - feats.shape[1]
            feats = jnp.pad(feats, ((0, 0), (0, extra), (0, 0)))
            mask = jnp.pad(mask, ((0, 0), (0, extra)))
        return feats[:, :keep], mask[:, :keep]

    def _augment(self, feats: jax.Array, mask: jax.Array, key: jax.Array) -> jax.Array:
        """Mel warp, then SpecAugment's band and frame masks (zeros), as ``Augment.features``
        draws them; a frame mask starts within the clip's own frames."""
        b, t, m = feats.shape
        k_warp, k_masks = jax.random.split(key)
        factor = 1 + self.mel_warp * jax.random.uniform(k_warp, (b,), minval=-1.0, maxval=1.0)
        out = fe.warp_mel(feats, factor) if self.mel_warp > 0 else feats
        bands = jnp.full((b,), float(m))
        valid = mask.sum(axis=1).astype(jnp.float32)  # a frame mask stays in the clip
        plans = [(self.freq_mask, bands, 2)] * self.freq_masks
        plans += [(self.time_mask, valid, 1)] * self.time_masks
        for i, (width, size, axis) in enumerate(plans):
            k_w, k_s = jax.random.split(jax.random.fold_in(k_masks, i))
            w = jnp.minimum(jnp.floor(jax.random.uniform(k_w, (b,)) * (width + 1)), size)
            start = jnp.floor(jax.random.uniform(k_s, (b,)) * (size - w + 1))
            pos = jnp.arange(m if axis == 2 else t, dtype=jnp.float32)[None]
            hit = (pos >= start[:, None]) & (pos < (start + w)[:, None])
            out = jnp.where(hit[:, None, :] if axis == 2 else hit[:, :, None], 0.0, out)
        return out
