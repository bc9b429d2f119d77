"""Round 4 of the loaders teams bring, through the real Trainer: streaming datasets, float64
and Python-number records, bucketed variable lengths, batches whose form changes mid-run
(fields added, keys reordered, a list in place of a tensor), spawned workers, ``Subset``/
``ConcatDataset``/``random_split`` and evaluation loaders of another form than training's.

Each runs a few steps on tiny data against what plain torch does with the same batches
(``from_torch``: the losses and weights step by step), or against the same run at one step
per call (``steps_per_call="auto"`` windows forced to K=4: the batches of a window stacked),
or is refused where torch refuses, naming the field and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset, random_split

import jaxcore
from jaxcore import BatchError
from jaxcore.models.digits import MLP
from tests.torchshell.loaders4_data import (
    Buckets,
    Numbered,
    Records,
    Rows,
    Sentences,
    Stream,
    X,
    Y,
    pad_collate,
)
from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell._errors import TorchModelError
from torchshell.module._windows import Windows

ROWS = TensorDataset(X, Y)


def _fit(
    module: L.LightningModule,
    train: Any,
    tmp_path: Path,
    val: Any = None,
    log_every: int = 1,
    **limits: Any,
) -> Recorder:
    logger = Recorder()
    L.Trainer(
        **(limits or {"max_epochs": 1}),
        logger=logger,
        log_every_n_steps=log_every,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(module, train, val)
    return logger


def _mlp(**kwargs: Any) -> JaxModule:
    return JaxModule(
        MLP(features=(16,), num_classes=3),
        jaxcore.softmax_cross_entropy,
        optax.sgd(0.1),
        print_summary=False,
        **kwargs,
    )


def _same_params(a: JaxModule, b: JaxModule) -> None:
    for p, q in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params), strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-5, atol=1e-6)


def _torch_steps(
    net: nn.Module, batches: Iterable[Any], steps: int, loss: Callable[[nn.Module, Any], Any]
) -> list[float]:
    """Plain torch: SGD(lr=0.1) on the first ``steps`` batches (cycling epochs)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out: list[float] = []
    while len(out) < steps:
        for batch in batches:
            if len(out) == steps:
                break
            opt.zero_grad()
            value = loss(net, batch)
            value.backward()
            opt.step()
            out.append(float(value.detach()))
    return out


def _twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    return net, ref


def _from_torch(net: nn.Module, loss: Any, **kwargs: Any) -> JaxModule:
    return JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False, **kwargs
    )


def _same_weights(jm: JaxModule, ref: nn.Module) -> None:
    got = jm.torch_state_dict()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.fixture
def k4(monkeypatch: pytest.MonkeyPatch) -> None:
    """``steps_per_call="auto"`` settles on K=4 (past its three timed steps)."""
    monkeypatch.setattr(Windows, "choose", staticmethod(lambda *_: 4))


# -- 1. a streaming IterableDataset -------------------------------------------------------
def test_a_streaming_dataset_trains_across_epochs_like_torch(tmp_path: Path) -> None:
    """No ``__len__``; 7 steps cross an epoch's ragged last batch of 5 rows (padded, masked)."""
    net, ref = _twins(lambda: nn.Linear(20, 3))
    jm = _from_torch(net, nn.CrossEntropyLoss())
    loader = DataLoader(Stream(), batch_size=8)  # no __len__; a last batch of 5 each epoch
    losses = _fit(jm, loader, tmp_path, max_steps=7).series("train/loss")
    want = _torch_steps(ref, loader, 7, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


def test_a_streaming_dataset_in_windows_trains_as_one_step_per_call(
    tmp_path: Path, k4: None
) -> None:
    """14 steps of K=4 windows over epochs of 5 batches: ragged batches inside windows."""
    runs = []
    for k in ("auto", 1):
        jm = _mlp(steps_per_call=k)
        _fit(jm, DataLoader(Stream(), batch_size=8), tmp_path, log_every=4, max_steps=14)
        assert jm.trainer.global_step == 14
        runs.append(jm)
    assert runs[0].window_k == 4 and runs[0].windows.runs > 0
    _same_params(*runs)


# -- 2. records of numpy float64 arrays and Python numbers -----------------------------------
def test_float64_records_into_a_float32_layer_are_refused_as_torch_refuses(
    tmp_path: Path,
) -> None:
    """``default_collate`` makes float64 of numpy float64 and Python floats; torch's float32
    ``nn.Linear`` refuses them, and so does the traced one (no silent float32)."""
    loader = DataLoader(Records(), batch_size=8)
    batch = next(iter(loader))
    assert batch["x"].dtype == batch["w"].dtype == torch.float64
    with pytest.raises(RuntimeError, match="Double and Float"):
        nn.Linear(20, 3)(batch["x"])
    jm = _from_torch(nn.Linear(20, 3), nn.CrossEntropyLoss())
    with pytest.raises(
        TorchModelError, match=r"input float64, weight float32.*Double and Float.*Fix: cast"
    ):
        _fit(jm, loader, tmp_path, max_steps=2)


def test_a_flax_model_on_float64_records_trains_as_on_float32(tmp_path: Path) -> None:
    """A Flax model follows JAX (float64 in float32 under x64 off): as the records cast to
    float32 in the collate."""

    def to32(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = torch.utils.data.default_collate(items)
        return {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}

    runs = []
    for collate in (None, to32):
        jm = _mlp()
        loader = DataLoader(Records(), batch_size=8, collate_fn=collate)
        runs.append((_fit(jm, loader, tmp_path, max_steps=3).series("train/loss"), jm))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    _same_params(runs[0][1], runs[1][1])


# -- 3. uint8 images and bool flags ----------------------------------------------------------
class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(20, 3)

    def forward(self, pixels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.lin(pixels.float() / 255 * keep[:, None])


def _pixels(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    x = torch.stack([a for a, _ in items])
    return {
        "pixels": ((x.clamp(-2, 2) + 2) * 60).to(torch.uint8),
        "keep": x[:, 0] > -0.5,
        "y": torch.stack([b for _, b in items]),
    }


def test_uint8_and_bool_fields_train_like_torch(tmp_path: Path) -> None:
    """uint8 pixels and a bool row flag, both read by ``forward``, kept in their dtypes."""
    net, ref = _twins(_Gated)
    jm = _from_torch(net, nn.CrossEntropyLoss(), inputs=("pixels", "keep"))
    loader = DataLoader(ROWS, batch_size=8, collate_fn=_pixels)
    losses = _fit(jm, loader, tmp_path, max_steps=5).series("train/loss")
    want = _torch_steps(
        ref, loader, 5, lambda m, b: F.cross_entropy(m(b["pixels"], b["keep"]), b["y"])
    )
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


# -- 4. bucketed variable lengths: pad_sequence + lengths --------------------------------------
class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).float()
        h = (self.emb(ids) * mask[..., None]).sum(1) / lengths[:, None].float()
        return self.head(h)


def test_a_bucketing_batch_sampler_trains_like_torch(tmp_path: Path) -> None:
    """A ``batch_sampler`` of length buckets: another padded ``T`` per batch (one compiled
    step per ``T``), ``lengths`` checked per batch."""
    data = Sentences()
    loader = DataLoader(data, batch_sampler=Buckets(data, 8), collate_fn=pad_collate)
    assert len({b["ids"].shape[1] for b in loader}) > 2  # T differs from batch to batch
    net, ref = _twins(_Bag)
    jm = _from_torch(net, nn.CrossEntropyLoss(), inputs=("ids", "lengths"))
    losses = _fit(jm, loader, tmp_path, max_steps=5).series("train/loss")
    want = _torch_steps(
        ref, loader, 5, lambda m, b: F.cross_entropy(m(b["ids"], b["lengths"]), b["y"])
    )
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


def test_accumulated_bucketed_batches_train_like_torch(tmp_path: Path) -> None:
    """``accumulate_grad_batches=2`` over batches of different ``T``."""
    data = Sentences()
    loader = DataLoader(data, batch_sampler=Buckets(data, 8), collate_fn=pad_collate)
    net, ref = _twins(_Bag)
    jm = _from_torch(net, nn.CrossEntropyLoss(), inputs=("ids", "lengths"))
    _fit(jm, loader, tmp_path, max_steps=2, accumulate_grad_batches=2)
    opt, batches = torch.optim.SGD(ref.parameters(), lr=0.1), iter(loader)
    for _ in range(2):  # Lightning's accumulation: each batch's loss / 2, one step per two
        opt.zero_grad()
        for b in (next(batches), next(batches)):
            (F.cross_entropy(ref(b["ids"], b["lengths"]), b["y"]) / 2).backward()
        opt.step()
    _same_weights(jm, ref)


class _FlaxBag(fnn.Module):
    @fnn.compact
    def __call__(self, ids: jax.Array, lengths: jax.Array) -> jax.Array:
        mask = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
        h = (fnn.Embed(30, 8)(ids) * mask[..., None]).sum(1) / lengths[:, None]
        return fnn.Dense(2)(h)


def test_bucketed_lengths_in_windows_train_as_one_step_per_call(tmp_path: Path, k4: None) -> None:
    """Windows of K=4 over batches of different ``T``."""
    data = Sentences()
    runs = []
    for k in ("auto", 1):
        jm = JaxModule(
            _FlaxBag(),
            jaxcore.softmax_cross_entropy,
            optax.sgd(0.1),
            inputs=("ids", "lengths"),
            steps_per_call=k,
            print_summary=False,
        )
        loader = DataLoader(data, batch_sampler=Buckets(data, 8), collate_fn=pad_collate)
        _fit(jm, loader, tmp_path, log_every=4, max_steps=10)
        assert jm.trainer.global_step == 10
        runs.append(jm)
    _same_params(*runs)


# -- 5. batches whose form changes mid-run -------------------------------------------------------
def _changing(items: list[tuple[torch.Tensor, torch.Tensor, int]]) -> Any:
    """Batch by batch (by position, from ``Numbered``'s indices): a dict, the same dict in
    another key order, with an id list, with ``y`` as a Python list, with an extra field."""
    x, y = torch.stack([a for a, _, _ in items]), torch.stack([b for _, b, _ in items])
    turn = items[0][2] // len(items) % 5
    if turn == 0:
        return {"x": x, "y": y}
    if turn == 1:
        return {"y": y, "x": x}
    if turn == 2:
        return {"x": x, "y": y, "id": [f"r{i}" for _, _, i in items]}
    if turn == 3:
        return {"x": x, "y": y.tolist()}
    return {"x": x, "w": torch.ones(len(y)), "y": y}


def test_a_loader_changing_its_batch_form_trains_like_torch(tmp_path: Path) -> None:
    """Each batch of another form than the last (the learned form of ``_form.py`` no longer
    fits) takes the full preparation: the losses and weights equal torch's on the same
    batches, a ragged last batch of one row included."""
    loader = DataLoader(Numbered(), batch_size=4, collate_fn=_changing)
    forms = {tuple(b) if isinstance(b["y"], torch.Tensor) else "list" for b in loader}
    assert len(forms) == 5
    net, ref = _twins(lambda: nn.Linear(20, 3))
    jm = _from_torch(net, nn.CrossEntropyLoss())
    losses = _fit(jm, loader, tmp_path, max_epochs=1).series("train/loss")
    want = _torch_steps(
        ref, loader, 10, lambda m, b: F.cross_entropy(m(b["x"]), torch.as_tensor(b["y"]))
    )
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


def test_a_loader_changing_its_batch_form_in_windows(tmp_path: Path, k4: None) -> None:
    """Windows of K=4 over batches of five forms."""
    runs = []
    for loader in (
        DataLoader(Numbered(), batch_size=8, collate_fn=_changing),
        DataLoader(ROWS, batch_size=8),
    ):
        jm = _mlp()
        _fit(jm, loader, tmp_path, log_every=4, max_steps=16)
        runs.append(jm)
    assert runs[0].windows.runs > 0
    _same_params(*runs)


# -- 6. spawned workers ---------------------------------------------------------------------
def test_spawned_workers_feed_the_same_batches_as_the_main_process(tmp_path: Path) -> None:
    """Two ``spawn`` workers (the Dataset in an importable module): the same run as in-process."""
    runs = []
    for workers in (
        {},
        {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True},
    ):
        jm = _mlp()
        loader = DataLoader(Rows(), batch_size=8, **workers)
        runs.append((_fit(jm, loader, tmp_path, max_steps=5).series("train/loss"), jm))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    _same_params(runs[0][1], runs[1][1])


# -- 7. three positions, the third the loss's sample weights -------------------------------
def _weighted(out: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    ce = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
    return ce * batch["w"], {}


def test_a_third_position_read_by_the_loss_as_sample_weights_trains_like_torch(
    tmp_path: Path,
) -> None:
    """``TensorDataset(x, y, w)`` with ``batch_keys=("x", "y", "w")`` and a JAX loss weighing rows
    by ``w``: torch's ``(ce * w).mean()``, the ragged last batch included."""
    w = (torch.arange(37) % 4 != 0).float() * 1.5
    data = TensorDataset(X, Y, w)
    net, ref = _twins(lambda: nn.Linear(20, 3))
    jm = _from_torch(net, _weighted, batch_keys=("x", "y", "w"))
    loader = DataLoader(data, batch_size=8)
    losses = _fit(jm, loader, tmp_path, max_epochs=1).series("train/loss")

    def torch_loss(m: nn.Module, b: list[torch.Tensor]) -> torch.Tensor:
        return (F.cross_entropy(m(b[0]), b[1], reduction="none") * b[2]).mean()

    want = _torch_steps(ref, loader, 5, torch_loss)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


# -- 8. Subset, ConcatDataset, random_split of the team's Dataset --------------------------
def test_subset_concat_and_random_split_train_like_torch(tmp_path: Path) -> None:
    """The team's Dataset through ``Subset``, ``random_split`` and ``ConcatDataset``."""
    half, _ = random_split(Rows(), [0.5, 0.5], generator=torch.Generator().manual_seed(1))
    data = ConcatDataset([Subset(Rows(), range(3, 15)), half])
    net, ref = _twins(lambda: nn.Linear(20, 3))
    jm = _from_torch(net, nn.CrossEntropyLoss())
    loader = DataLoader(data, batch_size=8, shuffle=False)
    losses = _fit(jm, loader, tmp_path, max_epochs=1).series("train/loss")
    want = _torch_steps(ref, loader, len(loader), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


# -- 9. evaluation batches of another form than training's -----------------------------------
def _as_dict(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([a for a, _ in items]), "y": torch.stack([b for _, b in items])}


def test_validation_dicts_beside_training_tuples_give_the_same_loss(tmp_path: Path) -> None:
    """Training on ``[x, y]`` lists, validating on dicts (the learned form switches each time)."""
    runs = []
    for collate in (None, _as_dict):
        jm = _mlp()
        val = DataLoader(ROWS, batch_size=8, **({"collate_fn": collate} if collate else {}))
        log = _fit(jm, DataLoader(Rows(), batch_size=8), tmp_path, val=val, max_epochs=2)
        runs.append((log.series("val/loss"), log.series("train/loss"), jm))
    assert len(runs[0][0]) == 2
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-6)
    _same_params(runs[0][2], runs[1][2])


# -- 10. (tensor, int) items with a Flax model reading position 0 ------------------------------
def test_tensor_int_items_with_a_positional_flax_input_train_as_a_tensor_dataset(
    tmp_path: Path,
) -> None:
    """``(tensor, int)`` items, ``inputs=(0,)``: as the same rows in a ``TensorDataset``."""
    runs = []
    for data in (ROWS, Rows()):
        jm = _mlp(inputs=(0,))
        log = _fit(jm, DataLoader(data, batch_size=8), tmp_path, max_steps=3)
        runs.append((log.series("train/loss"), jm))
    assert len(runs[1][0]) == 3
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    _same_params(runs[0][1], runs[1][1])


# -- 11. windows of batches the data axis does not divide ----------------------------------------
def test_batches_the_data_axis_does_not_divide_train_in_windows(tmp_path: Path, k4: None) -> None:
    """12-row batches on the 8-way test mesh in K=4 windows."""
    runs = []
    for k in ("auto", 1):
        jm = _mlp(steps_per_call=k)
        _fit(jm, DataLoader(ROWS, batch_size=12), tmp_path, log_every=4, max_steps=12)
        runs.append(jm)
    assert runs[0].windows.runs > 0
    _same_params(*runs)


# -- 12. a field whose dtype changes mid-run (a list in place of a tensor, int32 labels) ------
def _labels_int32_sometimes(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    return {"x": x, "y": y.int() if int(y.sum()) % 3 == 0 else y}


def _features_as_lists_sometimes(
    items: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Any]:
    x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    return {"x": x.tolist() if int(y.sum()) % 3 == 0 else x, "y": y}


def test_a_label_dtype_changing_mid_run_is_refused_as_torch_refuses(tmp_path: Path) -> None:
    """Before: int64 labels in the first batches, int32 in a later one (both int32 in JAX
    with x64 off): that batch ran the step traced for int64 and trained, where torch raises
    ``expected scalar type Long but found Int``. Now refused, naming the field."""
    loader = DataLoader(ROWS, batch_size=8, collate_fn=_labels_int32_sometimes)
    dtypes = [b["y"].dtype for b in loader]
    assert dtypes[0] == torch.int64 and torch.int32 in dtypes
    with pytest.raises(RuntimeError, match="expected scalar type Long but found Int"):
        _torch_steps(nn.Linear(20, 3), loader, 5, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))
    jm = _from_torch(nn.Linear(20, 3), nn.CrossEntropyLoss())
    with pytest.raises(
        BatchError,
        match=r"'y' is torch.int32 in this batch, but torch.int64 in the batch the step was "
        r"traced from.*Fix: give the field one dtype",
    ):
        _fit(jm, loader, tmp_path, max_steps=5)


def test_features_as_a_list_in_some_batches_are_refused_not_narrowed(tmp_path: Path) -> None:
    """A collate giving the features as a list of Python floats in some batches: they become
    float64 (as ``default_collate`` makes Python floats), which a float32 ``nn.Linear``
    refuses in torch; here that batch ran the float32 step. Now refused, naming the field."""
    jm = _from_torch(nn.Linear(20, 3), nn.CrossEntropyLoss())
    loader = DataLoader(ROWS, batch_size=8, collate_fn=_features_as_lists_sometimes)
    assert isinstance(next(iter(loader))["x"], torch.Tensor)
    with pytest.raises(BatchError, match=r"'x' is torch.float64 in this batch, but torch.float32"):
        _fit(jm, loader, tmp_path, max_steps=5)


def test_a_flax_model_takes_the_same_changes_as_jax_does(tmp_path: Path) -> None:
    """A Flax model's batch follows JAX's rule (64-bit values in 32 bits under x64 off),
    first batch or later: it trains as on the plain loader."""

    def both(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        batch = _labels_int32_sometimes(items)  # (int32 labels in batches 2, 3 and 5)
        if int(batch["y"].sum()) % 3 == 1:  # (batch 4: the features a list of floats)
            batch["x"] = batch["x"].tolist()
        return batch

    runs = []
    for collate in (None, both):
        jm = _mlp(steps_per_call=1)
        loader = DataLoader(ROWS, batch_size=8, **({"collate_fn": collate} if collate else {}))
        runs.append((_fit(jm, loader, tmp_path, max_steps=5).series("train/loss"), jm))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    _same_params(runs[1][1], runs[0][1])


# -- 13. class targets past the classes ------------------------------------------------------------
def _past_the_classes() -> DataLoader:
    y = Y.clone()
    y[3] = 5  # 3 classes
    return DataLoader(TensorDataset(X, y), batch_size=8)


def test_a_class_target_past_the_classes_is_refused_as_torch_refuses(tmp_path: Path) -> None:
    """A label of 5 for 3 classes: torch raises; the traced loss trained on it (now refused
    in the step, naming the value, as torch's IndexError does)."""
    loader = _past_the_classes()
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):
        _torch_steps(nn.Linear(20, 3), loader, 1, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    jm = _from_torch(nn.Linear(20, 3), nn.CrossEntropyLoss())
    with pytest.raises(Exception, match=r"(?s)5.*(out of bounds|3 classes)"):
        _fit(jm, loader, tmp_path, max_steps=2)


def test_a_flax_loss_names_a_label_past_the_classes(tmp_path: Path) -> None:
    """The same label under ``jaxcore.softmax_cross_entropy``: before, refused as NaN with the
    wrong cause ('lower the learning rate'); now named, as torch's IndexError names it."""
    with pytest.raises(Exception, match=r"(?s)'y'.*5.*(out of bounds|3 classes)"):
        _fit(_mlp(), _past_the_classes(), tmp_path, max_steps=2)


# -- 14. a DataLoader over a bare tensor ---------------------------------------------------------
def _reconstruction(out: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((out - batch["x"]) ** 2, axis=-1)


def test_an_autoencoder_on_a_dataloader_of_a_bare_tensor_trains_like_torch(
    tmp_path: Path,
) -> None:
    """Before: ``BatchError: Expected a batch collated to a dict, a list/tuple ..., got
    Tensor`` for ``DataLoader(x)`` (each batch one tensor, as torch gives it). Now it is the
    first position (``x``), as ``TensorDataset(x)``'s ``[x]`` is: weights equal torch's."""
    net, ref = _twins(lambda: nn.Linear(20, 20))
    jm = _from_torch(net, _reconstruction)
    loader = DataLoader(X, batch_size=8)
    losses = _fit(jm, loader, tmp_path, max_steps=5).series("train/loss")
    want = _torch_steps(ref, loader, 5, lambda m, b: F.mse_loss(m(b), b))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(jm, ref)


def test_prediction_on_a_dataloader_of_a_bare_tensor_gives_the_models_outputs(
    tmp_path: Path,
) -> None:
    """``trainer.predict`` on ``DataLoader(x)``: before, the same ``BatchError`` as training."""
    jm = _mlp()
    _fit(jm, DataLoader(ROWS, batch_size=8), tmp_path, max_steps=2)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    want = trainer.predict(jm, DataLoader(TensorDataset(X), batch_size=8))
    got = trainer.predict(jm, DataLoader(X, batch_size=8))
    assert got is not None and want is not None and len(got) == 5
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# -- 15. regression targets from Python floats -------------------------------------------------
class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(20, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).squeeze(-1)


def test_python_float_targets_under_mse_are_refused_as_torch_refuses(tmp_path: Path) -> None:
    """Regression targets as Python floats (float64): torch's ``MSELoss`` backward refuses
    them; coreshell trained in float32 (now refused naming the field and the fix)."""
    data = [(X[i], float(Y[i]) / 2) for i in range(37)]
    loader = DataLoader(data, batch_size=8)
    assert next(iter(loader))[1].dtype == torch.float64
    with pytest.raises(RuntimeError, match="Found dtype Double but expected Float"):
        _torch_steps(_Scalar(), loader, 1, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    with pytest.raises(Exception, match=r"(?s)float64.*Fix"):
        _fit(_from_torch(_Scalar(), nn.MSELoss()), loader, tmp_path, max_steps=2)
