"""Bad inputs, one test per row of docs/reliability.md that no other test file covers.

Each test feeds one bad input through the real path and asserts the error type and that the
message names what was expected, what came in, and the fix. Rows whose clear error is still
missing are ``xfail(strict=True)``: they start passing (and must lose the mark) when the owner
of the named file adds the check.
"""

from __future__ import annotations

import errno
import functools
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import jaxcore
import torchshell.checkpoint._orbax as ckpt
from jaxcore.models.digits import MLP
from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell._errors import CheckpointError, ShellError
from torchshell.checkpoint import OrbaxCheckpointIO, restore_state, save_state, verify
from torchshell.data.digits import DigitsDataModule
from torchshell.data.spoken_digits import SpokenDigitsDataError, SpokenDigitsDataset

ROWS = 16


def _batch(rows: int = ROWS, features: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.rand(rows, features, generator=g),
        "y": torch.randint(0, 10, (rows,), generator=g, dtype=torch.int32),
    }


@functools.lru_cache(maxsize=4)
def _initial(features: tuple[int, ...]) -> jaxcore.TrainState:
    return jaxcore.init_train_state(
        jaxcore.linen_model(MLP(features=features)),
        jaxcore.make_optimizer(),
        {k: jnp.asarray(v.numpy()) for k, v in _batch().items()},
        seed=0,
        mesh=jaxcore.make_mesh({"data": -1}),
    )


def _state(features: tuple[int, ...] = (16,)) -> jaxcore.TrainState:
    """A fresh copy of one initial state (steps donate their input state)."""
    return jax.tree.map(jnp.copy, _initial(features))


def _step(batch: dict[str, Any], nan_policy: str = "none") -> Any:
    """One real jitted train step on ``batch`` (numpy or jax arrays), MLP on 8 devices."""
    model = jaxcore.linen_model(MLP(features=(16,)))
    tx = jaxcore.make_optimizer()
    state = _state()
    step = jaxcore.make_train_step(
        model,
        jaxcore.softmax_cross_entropy,
        tx,
        state_sharding=jaxcore.state_shardings(state),
        nan_policy=nan_policy,
    )
    return step(state, {k: jnp.asarray(v) for k, v in batch.items()})


class _Batches(Dataset[dict[str, torch.Tensor]]):
    """A loader source that yields ready-made batches, bad ones included."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.batches[i]


def _fit(batches: list[dict[str, torch.Tensor]], **module_kwargs: Any) -> JaxModule:
    module = JaxModule(
        MLP(features=(16,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        print_summary=False,
        **module_kwargs,
    )
    trainer = quiet_trainer(max_steps=len(batches), log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(_Batches(batches), batch_size=None))
    return module


# -- batches --------------------------------------------------------------------------------
def test_wrong_input_key_is_named_with_the_fix():
    batch = _batch()
    with pytest.raises(jaxcore.BatchError) as err:
        _fit([{"image": batch["x"], "y": batch["y"]}])
    msg = str(err.value)
    assert "reads batch keys ['x']" in msg  # expected
    assert "the batch has ['image', 'mask', 'y']" in msg and "missing ['x']" in msg  # got
    assert "Fix: name the fields" in msg


@pytest.mark.parametrize(
    ("labels", "got"),
    [
        ({"label": np.zeros(ROWS, np.int32)}, "['label', 'x']"),
        ({"y": np.zeros(ROWS, np.float32)}, "float32"),
        ({"y": np.zeros((ROWS, 1), np.int32)}, f"({ROWS}, 1)"),
    ],
    ids=["missing-label-key", "float-labels", "labels-with-extra-dim"],
)
def test_bad_labels_name_the_field_expected_and_got(labels: dict[str, Any], got: str):
    batch = {"x": _batch()["x"].numpy(), **labels}
    with pytest.raises(jaxcore.BatchError) as err:
        _step(batch)
    msg = str(err.value)
    assert "'y'" in msg and "integer" in msg and got in msg and "Fix:" in msg


def test_field_shape_change_after_the_first_step_is_named():
    first, second = _batch(), _batch(features=32, seed=1)
    with pytest.raises(jaxcore.BatchError) as err:
        _fit([first, second])
    msg = str(err.value)
    assert "'x'" in msg and "64" in msg and "32" in msg and "Fix:" in msg


def test_labels_out_of_range_stop_at_the_first_step_under_nan_policy_stop():
    # Label 12 with 10 classes: the loss's index check refuses the step and names the labels
    # (as torch's IndexError does), not a NaN of unknown cause.
    batch = {"x": _batch()["x"].numpy(), "y": np.full(ROWS, 12, np.int32)}
    state, metrics = _step(batch, nan_policy="stop")
    assert float(metrics["nonfinite"]) == 1.0
    with pytest.raises(jaxcore.BatchError) as err:
        jaxcore.check_finite(state)
    msg = str(err.value)
    assert "labels ('y') hold 12 at step 0" in msg and "10 classes" in msg
    assert "Target 12 is out of bounds" in msg and "Fix: map the labels into [0, 9]" in msg


def test_inf_in_a_batch_is_refused_and_counted_under_skip():
    batch = {k: v.numpy() for k, v in _batch().items()}
    batch["x"][3, 5] = np.inf
    state, metrics = _step(batch, nan_policy="skip")
    assert float(metrics["nonfinite"]) == 1.0 and int(state.nonfinite) == 1
    assert int(state.step) == 1  # the step counter moves on, the params do not
    before = jax.device_get(_state().params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_under_the_real_trainer(policy: str):
    batches = [_batch(seed=i) for i in range(4)]
    batches[2]["x"][0, 0] = float("nan")
    if policy == "stop":  # a NaN in the input is named as such (the step looked at it)
        with pytest.raises(jaxcore.BatchError) as err:
            _fit(batches, nan_policy="stop")
        assert "['x'] holds NaN or Inf in rows [0] (of 16) at step 2" in str(err.value)
        assert "Fix:" in str(err.value) and "learning rate" not in str(err.value).split("(")[0]
        return
    module = _fit(batches, nan_policy="skip")
    assert int(module.state.nonfinite) == 1 and int(module.state.nonfinite_step) == 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(module.state.params)))


# -- data sets ------------------------------------------------------------------------------
def test_empty_training_split_is_refused_at_setup():
    dm = DigitsDataModule(val_fraction=0.5, test_fraction=0.6)  # nothing left to train on
    with pytest.raises(ShellError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "val_fraction" in msg and "test_fraction" in msg and "Fix:" in msg


def _clip_folder(tmp: Path, wav: bytes | None) -> Path:
    (tmp / "manifest.json").write_text(
        json.dumps({"clips": [{"split": "test", "path": "seven.wav", "label": 7}]})
    )
    if wav is not None:
        (tmp / "seven.wav").write_bytes(wav)
    return tmp


def test_spoken_digits_folder_without_manifest_is_named(tmp_path: Path):
    with pytest.raises(SpokenDigitsDataError) as err:
        SpokenDigitsDataset(tmp_path, "test")
    msg = str(err.value)
    assert f"No manifest.json in {tmp_path}" in msg  # got
    assert "expected a folder made by ensure_spoken_digits" in msg
    assert "Fix: call ensure_spoken_digits(root)" in msg


@pytest.mark.parametrize(
    "wav", [b"RIFF\x10\x00\x00\x00WAVEgarbage", None], ids=["corrupt-wav", "missing-wav"]
)
def test_unreadable_clip_is_named_with_the_fix(tmp_path: Path, wav: bytes | None):
    folder = _clip_folder(tmp_path, wav)
    with pytest.raises(SpokenDigitsDataError) as err:
        SpokenDigitsDataset(folder, "test")[0]
    msg = str(err.value)
    assert "seven.wav" in msg and "WAV" in msg and "ensure_spoken_digits" in msg
    assert "Fix:" in msg


# -- checkpoints ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Orbax checkpoint of the 64-16-10 MLP's state."""
    path = tmp_path_factory.mktemp("ck") / "state"
    save_state(path, _state((16,)))
    return path


def test_checkpoint_of_another_model_is_refused_naming_what_differs(saved16: Path):
    with pytest.raises(CheckpointError) as err:
        restore_state(saved16, _state((32,)))  # another width
    msg = str(err.value)
    assert "belongs to another model" in msg
    assert "params/layers_0/kernel (64, 16) vs (64, 32)" in msg
    assert "Fix: resume with the model and optimizer config" in msg
    with pytest.raises(CheckpointError) as err:
        restore_state(saved16, _state((16, 16)))  # another depth
    msg = str(err.value)
    assert "layers_1" in msg and "not in the checkpoint" in msg and "Fix:" in msg


def test_checkpoint_of_another_model_gives_a_clear_key_diff(saved16: Path):
    with pytest.raises(CheckpointError) as err:
        restore_state(saved16, _state((16, 16)))
    msg = str(err.value)
    assert "params/layers_1/kernel" in msg and "not in the checkpoint" in msg
    assert "partial_restore" not in msg and "NamedSharding" not in msg


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _write_export(directory: Path) -> None:
    (directory / "export").mkdir()
    _enospc()


def test_disk_full_while_checkpointing_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    state = _state()
    previous = tmp_path / "epoch=0-step=10.ckpt"
    OrbaxCheckpointIO(lambda: state, lambda _: None).save_checkpoint({"step": 10}, previous)
    assert verify(previous) is None
    cases = [  # (where the write fails, the checkpoint being written)
        ("export hook", tmp_path / "epoch=0-step=20.ckpt"),
        ("lightning.pt", tmp_path / "epoch=0-step=20.ckpt"),
        ("lightning.pt", previous),  # rewriting the same name
    ]
    for where, target in cases:
        hook = _write_export if where == "export hook" else None
        if where == "lightning.pt":
            monkeypatch.setattr(ckpt.torch, "save", _enospc)
        io = OrbaxCheckpointIO(lambda: state, lambda _: None, hook)
        with pytest.raises(CheckpointError) as err:
            io.save_checkpoint({"step": 20}, target)
        assert err.value.__cause__.errno == errno.ENOSPC
        assert [p.name for p in tmp_path.iterdir()] == [previous.name], where  # no partial dir
        assert verify(previous) is None, where  # the previous checkpoint is intact
    monkeypatch.undo()
    assert torch.load(previous / "lightning.pt", weights_only=True) == {"step": 10}


def test_a_kill_while_deleting_an_old_checkpoint_leaves_none_half_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    state = _state()
    io = OrbaxCheckpointIO(lambda: state, lambda _: None)
    old, new = tmp_path / "epoch=0-step=10.ckpt", tmp_path / "epoch=0-step=20.ckpt"
    for i, path in enumerate((old, new)):
        io.save_checkpoint({"step": i}, path)

    def killed_midway(path: Path, **kwargs: Any) -> None:
        (Path(path) / "manifest.json").unlink()  # the deletion got this far
        raise KeyboardInterrupt  # ... then the process died

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(new)  # Lightning removing a checkpoint past ckpt.keep
    assert not new.exists()  # hidden before the deletion started, not left half there
    assert ckpt.latest_checkpoint(tmp_path) == old


def test_disk_full_while_checkpointing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    state = _state()
    previous = tmp_path / "epoch=0-step=10.ckpt"
    OrbaxCheckpointIO(lambda: state, lambda _: None).save_checkpoint({"step": 10}, previous)
    monkeypatch.setattr(ckpt.torch, "save", _enospc)
    with pytest.raises(CheckpointError) as err:
        OrbaxCheckpointIO(lambda: state, lambda _: None).save_checkpoint(
            {"step": 20}, tmp_path / "epoch=0-step=20.ckpt"
        )
    msg = str(err.value)
    assert "step=20" in msg and "No space left" in msg and "Fix:" in msg


# -- indices, lengths and masks torch would refuse -------------------------------------------
class _Tokens(nn.Module):
    """Token ids -> nn.Embed(30) -> mean -> 10 classes."""

    @nn.compact
    def __call__(self, ids: jax.Array, train: bool = False) -> jax.Array:
        return nn.Dense(10)(nn.Embed(30, 8)(ids).mean(axis=1))


def _fit_tokens(ids: torch.Tensor) -> JaxModule:
    batch = {"ids": ids, "y": torch.zeros(ids.shape[0], dtype=torch.int32)}
    module = JaxModule(
        _Tokens(),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        inputs=("ids",),
        print_summary=False,
    )
    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(_Batches([batch]), batch_size=None))
    return module


def test_ids_past_a_flax_embed_table_are_refused_like_torch_before_any_step():
    ids = torch.randint(0, 30, (ROWS, 5), generator=torch.Generator().manual_seed(0))
    assert _fit_tokens(ids).state is not None  # in range: it trains
    ids[3, 2] = 49  # torch: IndexError: index out of range in self
    module = None
    with pytest.raises(jaxcore.BatchError) as err:
        module = _fit_tokens(ids)
    msg = str(err.value)
    assert "['ids']" in msg and "30 rows" in msg and "49" in msg and "IndexError" in msg
    assert "Fix:" in msg and "learning rate" not in msg
    assert module is None
    ids[3, 2] = -1
    with pytest.raises(jaxcore.BatchError, match="holds -1"):
        _fit_tokens(ids)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"lengths": torch.tensor([64] * (ROWS - 1) + [-3])}, "'lengths' holds -3 at row 15"),
        ({"mask": torch.ones(ROWS - 1, dtype=torch.bool)}, f"expected [{ROWS}]"),
        ({"x_mask": torch.ones(ROWS, 63, dtype=torch.bool)}, "'x_mask' has shape [16, 63]"),
    ],
    ids=["negative-length", "row-mask-of-wrong-length", "field-mask-of-wrong-length"],
)
def test_negative_lengths_and_masks_of_the_wrong_length_are_named(extra: dict, named: str):
    with pytest.raises(jaxcore.BatchError) as err:
        _fit([{**_batch(), **extra}])
    assert named in str(err.value) and "Fix:" in str(err.value)
    _fit([{**_batch(), "lengths": torch.full((ROWS,), 64), "x_mask": torch.ones(ROWS, 64)}])


class _LengthTagger(L.LightningModule):
    """A team's own module: dict batches, a mask built from ``lengths``, a torch loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        keep = torch.arange(64)[None, :] < batch["lengths"][:, None]
        logits = self.net(batch["x"] * keep)
        return torch.nn.functional.cross_entropy(logits, batch["y"].long())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"lengths": torch.tensor([64] * (ROWS - 1) + [-3])}, "'lengths' holds -3 at row 15"),
        (
            {"lengths": torch.full((ROWS,), 64), "x_mask": torch.ones(ROWS, 63)},
            "'x_mask' has shape [16, 63]",
        ),
    ],
    ids=["negative-length", "field-mask-of-wrong-length"],
)
def test_a_ported_lightning_module_gets_the_same_length_and_mask_checks(extra: dict, named: str):
    def fit(batch: dict[str, torch.Tensor]) -> JaxModule:
        module = JaxModule.from_lightning(_LengthTagger(), print_summary=False)
        trainer = quiet_trainer(max_steps=1, log_every_n_steps=1)
        trainer.fit(module, train_dataloaders=DataLoader(_Batches([batch]), batch_size=None))
        return module

    with pytest.raises(jaxcore.BatchError) as err:
        fit({**_batch(), **extra})
    assert named in str(err.value) and "Fix:" in str(err.value)
    assert fit({**_batch(), "lengths": torch.full((ROWS,), 64)}).state is not None
