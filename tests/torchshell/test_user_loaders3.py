"""DataLoaders whose collate returns numpy arrays or Python lists of numbers, through the Flax
path and ``from_torch`` (what ``test_user_batches.py`` does not cover: there every collate
returns tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax
import lightning as L
import numpy as np
import optax
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from jaxcore.models.digits import MLP
from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell.adapters._arrays import arrays_as_tensors

_g = torch.Generator().manual_seed(0)
X = torch.randn(37, 20, generator=_g)  # 37 rows: batches of 8, a padded last batch of 5
Y = torch.randint(0, 3, (37,), generator=_g)
ROWS = TensorDataset(X, Y)


def _numpy(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {"x": np.stack([a.numpy() for a, _ in items]), "y": np.array([int(b) for _, b in items])}


def _lists(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[Any]]:
    return {"x": [a.tolist() for a, _ in items], "y": [int(b) for _, b in items]}


def _fit(module: L.LightningModule, loader: DataLoader, tmp_path: Path, **limits: Any) -> Recorder:
    logger = Recorder()
    L.Trainer(
        **(limits or {"max_epochs": 1}),
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(module, loader, DataLoader(ROWS, batch_size=8, collate_fn=loader.collate_fn))
    return logger


@pytest.mark.parametrize("collate", [_numpy, _lists], ids=["numpy", "lists"])
def test_a_flax_model_trains_on_a_collate_of_numpy_or_number_lists_as_on_tensors(
    tmp_path: Path, collate: Any
) -> None:
    """Before: ``BatchError: The batch has no tensor field with a batch dimension: ['x',
    'y']`` (each numpy array or list was set aside as a host-only field, like a string).
    Now they are the tensors of the same values: the losses, validation loss and weights
    equal the default collate's (tensors) on an 8-device mesh with a padded last batch."""
    runs = []
    for fn in (None, collate):
        jm = JaxModule(MLP(features=(16,), num_classes=3), jaxcore.softmax_cross_entropy,
                       optax.sgd(0.1), print_summary=False)  # fmt: skip
        loader = DataLoader(ROWS, batch_size=8, **({"collate_fn": fn} if fn else {}))
        runs.append((_fit(jm, loader, tmp_path), jm))
    (want, plain), (got, ours) = runs
    assert len(got.series("train/loss")) == 5
    np.testing.assert_allclose(got.series("train/loss"), want.series("train/loss"), rtol=1e-6)
    np.testing.assert_allclose(got.series("val/loss"), want.series("val/loss"), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ours.state.params), jax.tree.leaves(plain.state.params),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_from_torch_trains_on_a_numpy_collate_like_torch(tmp_path: Path) -> None:
    """Before: the same ``BatchError`` for ``from_torch``; now its weights after 3 SGD steps
    equal torch's on the same batches."""
    torch.manual_seed(0)
    net, ref = nn.Linear(20, 3), nn.Linear(20, 3)
    ref.load_state_dict(net.state_dict())
    jm = JaxModule.from_torch(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    loader = DataLoader(ROWS, batch_size=8, collate_fn=_numpy)
    losses = _fit(jm, loader, tmp_path, max_steps=3).series("train/loss")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for _, batch in zip(range(3), loader, strict=False):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(torch.from_numpy(batch["x"])),
                                           torch.from_numpy(batch["y"]))  # fmt: skip
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(jm.torch_state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_only_numeric_arrays_and_number_lists_become_tensors() -> None:
    """Strings, ragged lists, lists of another length than the rows, Python scalars and
    string arrays stay host-only fields; numeric arrays keep their dtype (bfloat16 and
    float16 too) and their buffer."""
    import ml_dtypes

    x = np.ones((2, 3), np.float16)
    batch = {
        "inputs": {"x": x, "b": np.zeros((2,), ml_dtypes.bfloat16)},
        "y": [1, 0],
        "w": (0.5, 1.5),
        "keep": [True, False],
        "id": ["a", "b"],
        "ragged": [[1], [2, 3]],
        "classes": [0, 1, 2],  # not one per row: metadata, kept as it is
        "epoch": 3,
        "scale": np.float32(0.5),
        "names": np.array(["a", "b"]),
        "t": torch.ones(2),
    }
    out = arrays_as_tensors(batch)
    assert out["inputs"]["x"].dtype == torch.float16
    assert out["inputs"]["x"].data_ptr() == x.ctypes.data  # a view, no copy
    assert out["inputs"]["b"].dtype == torch.bfloat16
    assert out["y"].dtype == torch.int64 and out["y"].tolist() == [1, 0]
    assert out["w"].dtype == torch.float64 and out["keep"].dtype == torch.bool
    assert out["id"] == ["a", "b"] and out["ragged"] == [[1], [2, 3]]
    assert out["classes"] == [0, 1, 2] and out["epoch"] == 3 and out["scale"] == 0.5
    assert out["names"] is batch["names"] and out["t"] is batch["t"]


def test_a_field_without_the_batchs_rows_is_named_not_a_raw_sharding_error(
    tmp_path: Path,
) -> None:
    """Before: ``jax._src.sharding.IndivisibleError: Sharding NamedSharding(...) implies that
    array axis 0 is partitioned 8 times, but the dimension size is 3`` from inside JAX, for a
    collate adding per-class weights ``[3]`` to every batch. Now the bridge's own error names
    the field, the batch's shapes and the fix."""
    from bridge import TransferError

    def with_weights(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        return {"x": x, "y": y, "class_weights": torch.ones(3)}

    jm = JaxModule(MLP(features=(16,), num_classes=3), jaxcore.softmax_cross_entropy,
                   optax.sgd(0.1), print_summary=False)  # fmt: skip
    with pytest.raises(
        TransferError,
        match=r"Field 'class_weights' has shape \(3,\): its dim 0 is split over the mesh axis "
        r"'data' \(8 devices\), which does not divide 3.*'x': \(8, 20\).*Fix: give the field "
        r"one row per example",
    ):
        _fit(jm, DataLoader(ROWS, batch_size=8, collate_fn=with_weights), tmp_path, max_steps=2)


class _NestedMLP(fnn.Module):
    """Reads ``inputs["x"]`` of a nested batch ``{"inputs": {"x", "mask"}, "y"}``."""

    @fnn.compact
    def __call__(self, inputs: Any) -> Any:
        x = inputs["x"] * inputs["mask"][:, None]
        return fnn.Dense(3)(fnn.relu(fnn.Dense(16)(x)))


def _nested_with_ids(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    inputs = {"x": x, "mask": torch.ones(len(items), dtype=torch.bool)}
    return {"inputs": inputs, "y": y, "id": [f"row-{i}" for i in range(len(items))]}


def test_windows_of_k_steps_take_nested_batches_and_string_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: with the default steps_per_call="auto" past its first steps (K=4 here), a
    window stacked only top-level tensors: ``TypeError: expected Tensor as element 0 in
    argument 0, but got dict`` (a nested field) or ``... got HostOnly`` (a string field). Now
    the window stacks leaf by leaf and trains as one step per call does."""
    from torchshell.module._windows import Windows

    monkeypatch.setattr(Windows, "choose", staticmethod(lambda *_: 4))
    params = []
    for k in ("auto", 1):
        jm = JaxModule(_NestedMLP(), jaxcore.softmax_cross_entropy, optax.sgd(0.1),
                       inputs=("inputs",), steps_per_call=k, print_summary=False)  # fmt: skip
        loader = DataLoader(ROWS, batch_size=8, collate_fn=_nested_with_ids, shuffle=False)
        L.Trainer(max_steps=14, log_every_n_steps=4, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=tmp_path).fit(jm, loader)  # fmt: skip
        params.append(jm.state.params)
        assert k == 1 or (jm.window_k == 4 and jm.windows.runs > 0)
    for a, b in zip(*(jax.tree.leaves(p) for p in params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_0d_field_in_an_evaluation_batch_gets_the_exact_mean(tmp_path: Path) -> None:
    """Before: validation refused a batch with a 0-d field (``ValueError: ... P('data',)) is
    only valid for values of rank at least 1``: the eval step forced the batch sharding on
    every leaf). Now each leaf keeps its own placement, as in training."""

    def with_scalar(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        return {"x": x, "y": y, "temperature": torch.tensor(2.0)}

    losses = []
    for fn in (None, with_scalar):
        jm = JaxModule(MLP(features=(16,), num_classes=3), jaxcore.softmax_cross_entropy,
                       optax.sgd(0.1), print_summary=False)  # fmt: skip
        loader = DataLoader(ROWS, batch_size=8, **({"collate_fn": fn} if fn else {}))
        losses.append(_fit(jm, loader, tmp_path, max_steps=5).series("val/loss"))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


class _NestedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(20, 3)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(inputs["x"] * inputs["mask"][:, None])


def test_from_torch_takes_a_nested_dict_input_like_torch(tmp_path: Path) -> None:
    """Before: ``ValueError: entry not a 2- or 3- tuple`` from numpy (the static-read probe
    made one array of the whole dict). Now the weights after 3 SGD steps equal torch's."""
    torch.manual_seed(0)
    net, ref = _NestedNet(), _NestedNet()
    ref.load_state_dict(net.state_dict())
    jm = JaxModule.from_torch(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1),
                              inputs=("inputs",), print_summary=False)  # fmt: skip
    loader = DataLoader(ROWS, batch_size=8, collate_fn=_nested_with_ids)
    _fit(jm, loader, tmp_path, max_steps=3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _, batch in zip(range(3), loader, strict=False):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(batch["inputs"]), batch["y"]).backward()
        opt.step()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(jm.torch_state_dict()[name], value, rtol=1e-5, atol=1e-6)
