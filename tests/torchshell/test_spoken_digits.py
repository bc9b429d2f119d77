"""The spoken-digits recipe: offline data set, torchaudio features, Flax encoder, torch twin."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch

import bridge
import jaxcore
from jaxcore.models.spoken_digits import SpokenDigitsEncoder
from torchshell import JaxModule
from torchshell.data.spoken_digits import (
    BucketCollate,
    SpokenDigitsDataError,
    SpokenDigitsDataModule,
    SpokenDigitsDataset,
    ensure_spoken_digits,
)
from torchshell.twins.spoken_digits import SpokenDigitsEncoder as Twin
from torchshell.twins.spoken_digits import SpokenDigitsServing

TINY = {"takes": 1, "speakers": 4}
SMALL_MODEL = {"width": 32, "depth": 1, "heads": 2}


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_spoken_digits(tmp_path_factory.mktemp("sd"), **TINY)


def test_build_is_deterministic_split_by_speaker_and_idempotent(tiny_set: Path, tmp_path: Path):
    again = ensure_spoken_digits(tmp_path, **TINY)  # a fresh build elsewhere
    first = (tiny_set / "manifest.json").read_bytes()
    assert (again / "manifest.json").read_bytes() == first  # same clips, same audio checksums
    manifest = json.loads(first)
    clips = manifest["clips"]
    assert len(clips) == 40 and {c["label"] for c in clips} == set(range(10))
    speakers = {
        s: {c["speaker"] for c in clips if c["split"] == s} for s in ("train", "val", "test")
    }
    assert all(speakers.values())
    assert not (speakers["test"] & (speakers["train"] | speakers["val"]))  # unseen voices
    stamp = (again / "manifest.json").stat().st_mtime_ns
    assert ensure_spoken_digits(tmp_path, **TINY) == again  # cached: nothing rebuilt
    assert (again / "manifest.json").stat().st_mtime_ns == stamp
    (again / clips[0]["path"]).write_bytes(b"damaged")  # a bad checksum triggers a rebuild
    ensure_spoken_digits(tmp_path, **TINY)
    assert (again / "manifest.json").read_bytes() == first


def test_bad_settings_raise_clear_errors(tmp_path: Path):
    with pytest.raises(SpokenDigitsDataError, match="speakers"):
        ensure_spoken_digits(tmp_path, speakers=2)
    with pytest.raises(SpokenDigitsDataError, match="buckets"):
        BucketCollate((64, 32))
    with pytest.raises(SpokenDigitsDataError, match="largest bucket"):
        BucketCollate((8,))([{"features": torch.ones(9, 4), "y": torch.tensor(1)}])


def test_features_shapes_dtypes_and_buckets(tiny_set: Path):
    dm = SpokenDigitsDataModule(str(tiny_set.parent), batch_size=8, num_workers=0, **TINY)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["features"].dtype == torch.float32 and batch["frame_mask"].dtype == torch.bool
    assert batch["y"].dtype == torch.int32 and batch["y"].shape == (8,)
    assert batch["features"].shape[0] == 8 and batch["features"].shape[2] == 40
    assert batch["features"].shape[1] in (48, 64, 128)
    lengths = batch["frame_mask"].sum(1)
    assert (lengths > 10).all() and (batch["features"][~batch["frame_mask"]] == 0).all()
    # evaluation features are deterministic; training ones are augmented
    test_ds = dm.datasets["test"]
    assert torch.equal(test_ds[0]["features"], test_ds[0]["features"])
    train_ds = dm.datasets["train"]
    assert not torch.equal(train_ds[0]["features"], train_ds[0]["features"])


def _encoder_and_params(features: torch.Tensor, mask: torch.Tensor):
    model = SpokenDigitsEncoder(**SMALL_MODEL)
    params = model.init(jax.random.key(1), jnp.asarray(features.numpy()), jnp.asarray(mask.numpy()))
    return model, params["params"]


def test_export_parity_and_serving_waveform(tiny_set: Path):
    ds = SpokenDigitsDataset(tiny_set, "test")
    batch = BucketCollate()([ds[i] for i in range(6)])
    model, params = _encoder_and_params(batch["features"], batch["frame_mask"])
    jax_logits = np.asarray(
        model.apply({"params": params}, batch["features"].numpy(), batch["frame_mask"].numpy())
    )
    twin = Twin(**SMALL_MODEL).eval()
    twin.load_state_dict(bridge.export_state_dict(params, twin), strict=True)
    with torch.no_grad():
        torch_logits = twin(batch["features"], batch["frame_mask"]).numpy()
    assert np.abs(jax_logits - torch_logits).max() < 1e-4
    # padding to a larger bucket does not change a clip's logits
    wide = BucketCollate((128,))([ds[i] for i in range(6)])
    with torch.no_grad():
        assert (
            np.abs(twin(wide["features"], wide["frame_mask"]).numpy() - torch_logits).max() < 1e-4
        )
    # serving: a raw 16 kHz waveform through the torchaudio front-end gives the same logits
    import soundfile as sf

    wave, rate = sf.read(tiny_set / ds.clips[0]["path"], dtype="float32")
    serving = SpokenDigitsServing(twin).eval()
    with torch.no_grad():
        served = serving(torch.from_numpy(wave)[None]).numpy()
    assert rate == 16_000 and np.abs(served[0] - torch_logits[0]).max() < 1e-4
    features, frame_mask = twin.example_input()
    assert twin(features, frame_mask).shape == (2, 10)


def test_two_training_steps_through_lightning(tiny_set: Path):
    dm = SpokenDigitsDataModule(
        str(tiny_set.parent), batch_size=8, eval_batch_size=16, num_workers=0, **TINY
    )
    module = JaxModule(
        SpokenDigitsEncoder(**SMALL_MODEL),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-3),
        inputs=["features", "frame_mask"],
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and int(module.state.step) == 2
    trainer.test(module, datamodule=dm, verbose=False)
    assert 0.0 <= trainer.callback_metrics["test/accuracy"] <= 1.0
    assert np.isfinite(float(trainer.callback_metrics["test/loss"]))
