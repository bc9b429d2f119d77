"""jaxcore.features without torch: an independent numpy STFT, padding and batch invariance,
the waveform model's feature augmentation inside the step."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import features as fe
from jaxcore.models.spoken_digits import SpokenDigitsEncoder
from jaxcore.models.spoken_digits_waveform import SpokenDigitsWaveformEncoder


def _numpy_log_mel(wave: np.ndarray) -> np.ndarray:
    """One clip, float64: center=True reflect padding, periodic Hann, |rfft|^2, HTK mel."""
    n_fft, hop = 400, 160
    padded = np.pad(wave.astype(np.float64), n_fft // 2, mode="reflect")
    frames = 1 + (padded.shape[0] - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    stack = np.stack([padded[t * hop : t * hop + n_fft] * window for t in range(frames)])
    power = np.abs(np.fft.rfft(stack, axis=-1)) ** 2
    x = np.log10(np.maximum(power @ fe.mel_filterbank(201, 40, 16_000), 1e-10))
    return (np.maximum(x, x.max() - 8.0) + 4.0) / 4.0


def _clips() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for n in (8_000, 5_555, 1_000):
        t = np.arange(n) / 16_000
        out.append(0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * rng.standard_normal(n))
    return [c.astype(np.float32) for c in out]


def _batch(clips: list[np.ndarray], width: int) -> tuple[jax.Array, jax.Array]:
    wave = np.zeros((len(clips), width), np.float32)
    for row, c in enumerate(clips):
        wave[row, : c.shape[0]] = c
    return jnp.asarray(wave), jnp.asarray([c.shape[0] for c in clips])


def test_log_mel_equals_a_numpy_stft_clip_by_clip_whatever_the_padding():
    clips = _clips()
    for width in (8_000, 9_600):
        feats, mask = fe.log_mel(*_batch(clips, width))
        for row, c in enumerate(clips):
            ref = _numpy_log_mel(c)
            assert int(mask[row].sum()) == ref.shape[0] == c.shape[0] // 160 + 1
            assert np.abs(np.asarray(feats[row, : ref.shape[0]]) - ref).max() < 1e-4
            assert not np.asarray(feats[row, ref.shape[0] :]).any()


def test_trim_keeps_the_voiced_span_and_shapes():
    x = jnp.full((2, 120, 40), -0.5).at[0, 70:90].set(1.0).at[1, 5:30].set(1.0)
    mask = jnp.arange(120)[None] < jnp.array([[120], [50]])
    kept, new_mask = fe.trim_silence(x, mask)
    assert kept.shape == x.shape
    assert np.asarray(new_mask.sum(1)).tolist() == [36, 38]  # 20 + 8 + 8; 25 + 5 + 8
    assert float(kept[0, 8:28].min()) == 1.0 and not np.asarray(kept[0, 36:]).any()


def test_waveform_model_augments_in_training_only_from_the_dropout_rng():
    small = {"width": 16, "depth": 1, "heads": 2, "dropout": 0.0}
    model = SpokenDigitsWaveformEncoder(
        **small, train_frames=40, mel_warp=0.06, freq_masks=2, time_masks=2
    )
    wave, lengths = _batch(_clips(), 8_000)
    # the same parameters as the encoder over features (cheaper to initialise)
    variables = SpokenDigitsEncoder(**small).init(
        jax.random.key(0), jnp.zeros((1, 40, 40)), jnp.ones((1, 40), bool)
    )

    @jax.jit
    def run(key: jax.Array) -> tuple[jax.Array, ...]:
        def go(m: SpokenDigitsWaveformEncoder, train: bool) -> jax.Array:
            return m.apply(variables, wave, lengths, train=train, rngs={"dropout": key})

        return go(model, True), go(model, False)

    (a, ea), (b, eb), (c, _) = (run(jax.random.key(k)) for k in (1, 2, 1))
    assert np.array_equal(a, c) and not np.allclose(a, b)  # drawn from the step's rng
    assert np.array_equal(ea, eb)  # evaluation: no augmentation
    feats, mask = model.features(wave, lengths, train=True)
    assert feats.shape == (3, 40, 40) and mask.shape == (3, 40)


def test_warp_mel_reads_scaled_bands():
    f = jnp.tile(jnp.arange(8.0), (2, 3, 1))
    out = fe.warp_mel(f, jnp.array([1.0, 0.5]))
    assert np.allclose(out[0], f[0]) and np.allclose(out[1, 0], np.arange(8.0) * 0.5)
