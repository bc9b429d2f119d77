"""Traced torch code that trained where plain torch raises, or failed with a bare assertion.

- int32 class indices (``nn.CrossEntropyLoss``, ``F.cross_entropy``, ``nn.NLLLoss``, a
  team's own loss function, a ``LightningModule``'s ``training_step``): torch 2.9 raises
  ``expected scalar type Long but found Int``; the traced step took them, as the bridge
  hands ``int64`` labels over as ``int32`` too (x64 off). They are refused now, naming the
  batch field, the dtype and the fix, while ``int64`` labels and ``int32`` targets computed
  in the step (torch's ``int64``) still train.
- The functional ``aten.uniform`` with ``from > to``: torchax raised a bare
  ``AssertionError``; torch raises ``uniform_ expects to return a [from, to) range``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns

_LONG = "expected scalar type Long but found Int"


def _rows(dtype: torch.dtype, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g).to(dtype)


def _own_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A team's own loss function, as written for torch."""
    return F.cross_entropy(out, y, label_smoothing=0.1)


def _fit_torch(loss: Any, dtype: torch.dtype) -> L.Trainer:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if isinstance(loss, nn.NLLLoss):
        net.append(nn.LogSoftmax(-1))
    module = JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), inputs=(0,), print_summary=False
    )
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, DataLoader(TensorDataset(*_rows(dtype)), batch_size=8))
    return trainer


_LOSSES = [nn.CrossEntropyLoss(), F.cross_entropy, nn.NLLLoss(), _own_loss]
_IDS = ["CrossEntropyLoss", "F.cross_entropy", "NLLLoss", "own_function"]


@pytest.mark.parametrize("loss", _LOSSES, ids=_IDS)
def test_int32_class_targets_are_refused_through_from_torch(loss: Any) -> None:
    """Refused naming the field; the same loss on int64 labels trains."""
    x, y = _rows(torch.int32)
    with pytest.raises(RuntimeError, match=_LONG):  # plain torch
        F.nll_loss(x[:, :3].log_softmax(-1), y)
    with pytest.raises(TorchModelError) as info:
        _fit_torch(loss, torch.int32)
    message = str(info.value)
    assert "class-index target is batch['y']" in message, message
    assert "DataLoader gives as int32" in message and _LONG in message, message
    assert "Fix: .long() on the labels in the Dataset or collate" in message, message
    assert _fit_torch(loss, torch.int64).global_step == 2


def test_int16_targets_of_a_teams_own_loss_function_are_refused() -> None:
    """A loss function of the team's (not a torch loss) ran its ``F.cross_entropy`` with no
    target check: int16 labels trained. Refused as for ``nn.CrossEntropyLoss``."""
    with pytest.raises(TorchModelError, match="class-index target is int16"):
        _fit_torch(_own_loss, torch.int16)


class _Classifier(L.LightningModule):
    """A classifier as Lightning's docs write one; ``target`` picks what the loss gets."""

    def __init__(self, target: str = "field") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.target = target

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (batch["x"], batch["label"]) if isinstance(batch, dict) else batch
        logits = self.net(x)
        if self.target == "long":  # the labels as torch needs them, cast in the step
            y = y.long()
        elif self.target == "pseudo":  # targets computed in the step (torch's int64)
            y = logits.detach().argmax(-1)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Labelled(Dataset):
    """Rows ``{"x", "label"}`` with numpy int32 labels (``np.int32`` scalars collate to an
    int32 tensor)."""

    def __init__(self) -> None:
        self.x, y = _rows(torch.int64)
        self.y = y.numpy().astype(np.int32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "label": self.y[i]}


@pytest.mark.parametrize("batches", ["tuple", "dict"])
def test_int32_class_targets_are_refused_through_from_lightning(batches: str) -> None:
    """Refused naming the field. The same loader trains where the step casts the labels
    (``y.long()``: int32 in the trace, as every int64 there) or computes its targets
    (``argmax``): what torch takes."""
    loader = (
        DataLoader(TensorDataset(*_rows(torch.int32)), batch_size=8)
        if batches == "tuple"
        else DataLoader(_Labelled(), batch_size=8)
    )
    assert next(iter(loader))[1 if batches == "tuple" else "label"].dtype == torch.int32
    with pytest.raises(TorchModelError) as info:
        quiet_trainer(max_steps=2).fit(
            JaxModule.from_lightning(_Classifier(), print_summary=False), loader
        )
    field = "batch[1]" if batches == "tuple" else "batch['label']"
    message = str(info.value)
    assert f"cross_entropy: the class-index target is {field}" in message, message
    assert "int32" in message and _LONG in message and "Fix: .long()" in message, message
    for target in ("long", "pseudo"):
        trainer = quiet_trainer(max_steps=2)
        trainer.fit(JaxModule.from_lightning(_Classifier(target), print_summary=False), loader)
        assert trainer.global_step == 2, target


# -- aten.uniform ------------------------------------------------------------------------------


class _Noisy(L.LightningModule):
    """Noise drawn with the functional op in ``training_step`` (``torch.ops.aten.uniform``,
    what ``uniform_`` lowers to in functionalised code)."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)
        self.low, self.high = low, high

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        noise = torch.ops.aten.uniform(torch.empty_like(x), self.low, self.high)
        return F.cross_entropy(self.net(x + noise), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_functional_uniform_with_from_above_to_is_refused_as_torch() -> None:
    """Refused with torch's message, the values and the fix; in range, the op draws in
    ``[from, to)`` from the step's key (traced directly) and the module trains."""
    with pytest.raises(RuntimeError, match=r"uniform_ expects to return a \[from, to\) range"):
        torch.ops.aten.uniform(torch.empty(3), 0.5, -0.5)  # plain torch
    loader = DataLoader(TensorDataset(*_rows(torch.int64)), batch_size=8)
    with pytest.raises(TorchModelError) as info:
        quiet_trainer(max_steps=2).fit(
            JaxModule.from_lightning(_Noisy(0.5, -0.5), print_summary=False), loader
        )
    message = str(info.value)
    assert "aten.uniform(from=0.5, to=-0.5)" in message, message
    assert "training_step" in message or "_Noisy" in message, message
    assert "found from=0.5 > to=-0.5" in message and "AssertionError" not in message, message
    assert "Fix: swap the bounds (aten.uniform(from=-0.5, to=0.5))" in message, message

    class Op(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.uniform(x, -0.5, 0.25)

    fns = torch_model_fns(Op(), ("x",))

    def draw(x: jax.Array, key: int) -> jax.Array:
        return fns.apply({}, {}, {"x": x}, jax.random.key(key), True)[0]

    first = np.asarray(jax.jit(draw, static_argnums=1)(jnp.zeros(4096), 0))
    second = np.asarray(jax.jit(draw, static_argnums=1)(jnp.zeros(4096), 1))
    assert first.dtype == np.float32 and first.min() >= -0.5 and first.max() < 0.25
    assert abs(first.mean() - (-0.125)) < 0.01 and not np.array_equal(first, second)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(JaxModule.from_lightning(_Noisy(-0.1, 0.1), print_summary=False), loader)
    assert trainer.global_step == 2
