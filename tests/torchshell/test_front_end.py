"""The spoken-digits front end on the device (issue 40): JAX log-mel and trimming equal the
torchaudio path's, and the recipe trains, evaluates and exports with ``data.front_end=device``."""

from pathlib import Path

import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch

import bridge
from jaxcore import features as fe
from jaxcore.models.spoken_digits_waveform import SpokenDigitsWaveformEncoder
from torchshell.app.config import compose_config, typed
from torchshell.app.prepare import build
from torchshell.data.spoken_digits import (
    LogMel,
    SpokenDigitsDataset,
    WaveCollate,
    ensure_spoken_digits,
    trim_clips,
    trim_silence,
)
from torchshell.twins.spoken_digits import SpokenDigitsServing
from torchshell.twins.spoken_digits_waveform import SpokenDigitsWaveformEncoder as WaveTwin

TINY = {"takes": 1, "speakers": 4}
SMALL = {"width": 16, "depth": 1, "heads": 2}
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_spoken_digits(tmp_path_factory.mktemp("sd"), **TINY)


def _padded(waves: list[torch.Tensor], extra: int = 0) -> tuple[jnp.ndarray, jnp.ndarray]:
    batch = torch.zeros(len(waves), max(w.shape[0] for w in waves) + extra)
    for row, w in enumerate(waves):
        batch[row, : w.shape[0]] = w
    return jnp.asarray(batch.numpy()), jnp.asarray([w.shape[0] for w in waves])


def _ragged_audio() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = (16_000, 9_001, 450, 12_345, 230)  # ragged, two shorter than n_fft
    return [torch.randn(n, generator=g) * 0.05 * (i + 1) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("source", ["clips", "random"])
def test_jax_log_mel_equals_torchaudio(tiny_set: Path, source: str):
    lm = LogMel()
    if source == "clips":
        ds = SpokenDigitsDataset(tiny_set, "test")
        waves = [ds.wave(i) for i in range(8)]
    else:
        waves = _ragged_audio()
    assert len({w.shape[0] for w in waves}) > 1  # ragged
    wave, lengths = _padded(waves, extra=1_000)  # padding past the longest too
    feats, mask = fe.log_mel(wave, lengths, reflect="clip")  # each clip alone: LogMel(clip)
    for row, w in enumerate(waves):
        ref = lm(w).numpy()
        t = ref.shape[0]
        assert int(mask[row].sum()) == t and bool(mask[row, :t].all())
        assert np.abs(np.asarray(feats[row, :t]) - ref).max() < TOL
        assert float(jnp.abs(feats[row, t:]).max(initial=0.0)) == 0.0
    # a training batch: LogMel.many (reflect at the longest clip's end, not the padding's)
    feats, mask = fe.log_mel(wave, lengths, reflect="batch")
    for row, ref in enumerate(lm.many(waves)):
        t = ref.shape[0]
        assert np.abs(np.asarray(feats[row, :t]) - ref.numpy()).max() < TOL
    # trimming: the same frames and mask as the torch function on the same features
    feats, mask = fe.log_mel(wave, lengths, reflect="clip")
    kept, new_mask = fe.trim_silence(feats, mask)
    ref_kept, ref_mask = trim_silence(
        torch.from_numpy(np.array(feats)), torch.from_numpy(np.array(mask))
    )
    assert np.array_equal(np.asarray(new_mask), ref_mask.numpy())
    assert np.abs(np.asarray(kept) - ref_kept.numpy()).max() < TOL


def test_mel_filterbank_equals_torchaudio():
    import torchaudio

    ref = torchaudio.functional.melscale_fbanks(201, 0.0, 8000.0, 40, 16_000).numpy()
    assert np.abs(fe.mel_filterbank(201, 40, 16_000) - ref).max() < 1e-5


def test_device_model_sees_the_host_path_frames(tiny_set: Path):
    """The data set's items (evaluation; training on the same augmented waves) equal what the
    waveform model feeds its encoder, frame for frame and mask for mask."""
    model = SpokenDigitsWaveformEncoder(**SMALL, train_frames=40, eval_frames=160)
    host = SpokenDigitsDataset(tiny_set, "test")
    device = SpokenDigitsDataset(tiny_set, "test", front_end="device")
    items = [device[i] for i in range(8)]
    batch = WaveCollate()(items)
    assert set(batch) == {"waveform", "lengths", "y"} and batch["waveform"].shape[1] == 16_000
    feats, mask = model.features(
        jnp.asarray(batch["waveform"].numpy()), jnp.asarray(batch["lengths"].numpy())
    )
    for row in range(8):
        ref = host.host_item(row)["features"].numpy()
        assert int(mask[row].sum()) == ref.shape[0]
        assert np.abs(np.asarray(feats[row, : ref.shape[0]]) - ref).max() < TOL
    # training: the host crops LogMel.many's trimmed frames; the model does the same in train
    waves = [host.wave(i) * 3.0 for i in range(6)]
    ref = [f[:40] for f in trim_clips(LogMel().many(waves))]
    wave, lengths = _padded(waves, extra=500)
    feats, mask = model.features(wave, lengths, train=True)
    assert feats.shape[1] == 40
    for row, r in enumerate(ref):
        assert int(mask[row].sum()) == r.shape[0]
        assert np.abs(np.asarray(feats[row, : r.shape[0]]) - r.numpy()).max() < TOL


def test_training_items_are_augmented_waveforms_only(tiny_set: Path):
    ds = SpokenDigitsDataset(tiny_set, "train", train=True, front_end="device")
    items = ds.__getitems__([0, 1, 2])
    assert all(set(item) == {"waveform", "y"} and item["waveform"].dim() == 1 for item in items)
    # leading/trailing silence and speed change the length; the clip is not cropped
    assert any(item["waveform"].shape[0] != ds.wave(i).shape[0] for i, item in enumerate(items))
    batch = WaveCollate((1_000,))(items)  # longer than the last bucket: a multiple of it
    assert batch["waveform"].shape[1] % 1_000 == 0
    assert batch["lengths"].tolist() == [item["waveform"].shape[0] for item in items]


def test_bad_front_end_is_refused():
    from torchshell._errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.front_end='gpu'.*Fix"):
        typed(compose_config(["data.front_end=gpu"]))
    with pytest.raises(ConfigError, match="no device_front_end"):
        typed(compose_config(["data.front_end=device", "model.device_front_end=null"]))
    cfg = typed(compose_config([]))
    assert cfg.data["front_end"] == "host" and cfg.model.inputs == ["features", "frame_mask"]


def test_recipe_trains_evaluates_and_exports_with_the_device_front_end(tiny_set: Path):
    overrides = [
        "data.front_end=device",
        f"data.root={tiny_set.parent}",
        "data.wave_buckets=[32000]",  # one compiled shape per step kind
        "data.takes=1",
        "data.speakers=4",
        "data.num_workers=0",
        "data.batch_size=16",
        "data.eval_batch_size=16",
        "++data.min_test_clips=0",
        "model.flax.width=32",
        "model.flax.depth=1",
        "model.flax.heads=2",
        "optim.lr=3e-3",
        "optim.schedule=constant",
        "mesh=single",
    ]
    cfg = typed(compose_config(overrides))
    data, module, twin = build(cfg)
    assert type(twin) is WaveTwin and cfg.model.inputs == ["waveform", "lengths"]
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, *args):
            losses.append(float(np.asarray(outputs["loss"])))  # plain Lightning's outputs

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=data)
    assert len(losses) == 20 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses
    trainer.test(module, datamodule=data, verbose=False)
    assert 0.0 <= float(trainer.callback_metrics["test/accuracy"]) <= 1.0
    # export: the twin over waveforms equals the JAX model; its serving module is the host
    # path's (raw waveform and lengths in), with the same logits
    twin.load_state_dict(bridge.export_state_dict(module.state.params, twin), strict=True)
    batch = next(iter(data.test_dataloader()))
    jax_logits = module.predict_step(batch, 0).numpy()
    twin.eval()
    with torch.no_grad():
        torch_logits = twin(batch["waveform"], batch["lengths"]).numpy()
        serving = twin.serving()
        served = serving(batch["waveform"], batch["lengths"]).numpy()
    assert np.abs(jax_logits - torch_logits).max() < TOL
    assert type(serving) is SpokenDigitsServing and serving.input_names == ("waveform", "lengths")
    assert np.abs(served - torch_logits).max() < TOL
    assert set(twin.state_dict()) == set(twin.plain().state_dict())
