"""Class-index targets outside ``[0, C)`` in a traced step (issues 51/52, never silently
different): torch raises ``IndexError: Target N is out of bounds``; the one-hot select of
``trace/_nll.py`` (and torchax's gather) gave that row 0 and trained on. Now the step is
refused and the fit raises a ``BatchError`` naming the loss, the field, the value and the fix,
on every way a loss reaches the trace: ``from_torch`` with a loss module, with a loss function,
a model computing its own loss (``from_lightning``), ``F.nll_loss`` by a direct reference, an
evaluation batch. Targets inside the classes or at ``ignore_index`` train as in torch."""

from __future__ import annotations

from typing import Any

import jax
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import nll_loss as nll_loss_imported  # (before the trace patches F)
from torch.utils.data import DataLoader

import jaxcore
from tests.helpers import quiet_trainer
from torchshell import JaxModule

ROWS, FEATURES, CLASSES, STEPS = 8, 6, 4, 2


def _batches(bad: int | None, at: int = 0, ignore: int | None = None) -> list[Any]:
    """``STEPS`` batches ``(x, y)``; ``y[3]`` of batch ``at`` set to ``bad``, ``y[5]`` of
    every batch to ``ignore``."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(STEPS):
        x = torch.randn(ROWS, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (ROWS,), generator=g)
        if i == at and bad is not None:
            y[3] = bad
        if ignore is not None:
            y[5] = ignore
        out.append((x, y))
    return out


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES)


class _Lit(L.LightningModule):
    """A LightningModule whose ``training_step`` computes ``loss(logits, y)``."""

    def __init__(self, loss: Any) -> None:
        super().__init__()
        self.net, self.loss = _net(), loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _LitVal(_Lit):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss(self.net(x), y))


def _from_torch(loss: Any) -> JaxModule:
    net = _net()
    return JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )


def _fit(module: L.LightningModule, batches: list[Any], val: list[Any] | None = None) -> None:
    trainer = quiet_trainer(max_steps=len(batches), log_every_n_steps=1, num_sanity_val_steps=0)
    loader = DataLoader(batches, batch_size=None)
    trainer.fit(module, loader, DataLoader(val, batch_size=None) if val else None)


def _refused(module: JaxModule, batches: list[Any], val: list[Any] | None = None) -> str:
    """The fit's error; what it says is checked; the weights hold no NaN."""
    with pytest.raises(jaxcore.BatchError) as err:
        _fit(module, batches, val)
    msg = str(err.value)
    assert "is out of bounds" in msg and "expected class indices in [0, 3]" in msg, msg
    assert "Fix: map" in msg and "learning rate" not in msg, msg
    leaves = jax.tree.leaves(jax.device_get(module.state.params))
    assert leaves and all(np.isfinite(v).all() for v in leaves)
    return msg


def _torch_raises(bad: int, ignore_index: int = -100) -> None:
    x, y = _batches(bad)[0]
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        F.cross_entropy(_net()(x), y, ignore_index=ignore_index)


WAYS = {
    "module": lambda: _from_torch(nn.CrossEntropyLoss()),
    "function": lambda: _from_torch(lambda out, y: F.cross_entropy(out, y)),
    "lightning": lambda: JaxModule.from_lightning(_Lit(F.cross_entropy), print_summary=False),
}


@pytest.mark.parametrize(
    ("way", "bad", "at"), [("module", 7, 1), ("function", 4, 0), ("lightning", -1, 0)]
)
def test_a_target_outside_the_classes_is_refused_naming_field_value_and_fix(
    way: str, bad: int, at: int
) -> None:
    """Before: the row's loss was 0 and the fit trained on (the function and the Lightning
    ways); torch raises ``IndexError: Target 7 is out of bounds.``."""
    _torch_raises(bad)
    msg = _refused(WAYS[way](), _batches(bad, at))
    loss = "CrossEntropyLoss" if way == "module" else "cross_entropy"
    field = "batch['y']" if way != "lightning" else "batch[1]"
    assert msg.startswith(f"{loss}: the target {field} holds {bad} at step {at} (refused"), msg
    assert f"IndexError: Target {bad} is out of bounds" in msg, msg


class _Seq(nn.Module):
    """``[N, F, L]`` -> ``[N, C, L]`` (K-dim cross_entropy, nll_loss2d's path for 4-d)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(FEATURES, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _seq_batches(bad: int | None) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, CLASSES, (ROWS, 5), generator=g)
        y[:, 4] = -100  # (ignored positions)
        if bad is not None:
            y[2, 3] = bad
        out.append((torch.randn(ROWS, FEATURES, 5, generator=g), y))
    return out


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.NLLLoss()], ids=["ce", "nll"])
def test_a_k_dim_target_outside_the_classes_is_refused(loss: nn.Module) -> None:
    x, y = _seq_batches(9)[0]
    with pytest.raises(IndexError, match="Target 9 is out of bounds"):
        loss(_Seq()(x), y)
    net = _Seq()
    module = JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    msg = _refused(module, _seq_batches(9))
    assert f"{type(loss).__name__}: the target batch['y'] holds 9 at step 0" in msg, msg


def test_nll_loss_by_a_direct_reference_is_checked_in_its_lowering() -> None:
    """``from torch.nn.functional import nll_loss`` before the trace: no F-level check runs;
    the ``aten.nll_loss`` lowering reports the target itself."""
    _torch_raises(5)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nll_loss_imported(out.log_softmax(1), y)

    msg = _refused(JaxModule.from_lightning(_Lit(loss), print_summary=False), _batches(5))
    assert msg.startswith("nll_loss: the target batch[1] holds 5 at step 0"), msg


def test_a_validation_batch_outside_the_classes_is_refused() -> None:
    module = JaxModule.from_lightning(_LitVal(F.cross_entropy), print_summary=False)
    msg = _refused(module, _batches(None), val=_batches(6))
    assert "holds 6 in a validation_step batch" in msg, msg


def _torch_weights(batches: list[Any], loss: Any) -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        loss(net(x), y).backward()
        opt.step()
    return net.state_dict()


def _k_dim_view(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The K-dim form on views (``y[:, None]``: a torchax View in the trace)."""
    return F.cross_entropy(out[..., None], y[:, None], ignore_index=-1)


@pytest.mark.parametrize("way", ["module", "lightning", "view"])
def test_targets_inside_the_classes_or_ignored_train_as_torch(way: str) -> None:
    """``ignore_index=-1`` rows (below 0, so outside the classes) are skipped, not refused;
    the weights after two SGD steps are torch's."""
    batches = _batches(None, ignore=-1)
    loss = _k_dim_view if way == "view" else nn.CrossEntropyLoss(ignore_index=-1)
    module = (
        _from_torch(loss)
        if way == "module"
        else JaxModule.from_lightning(_Lit(loss), print_summary=False)
    )
    _fit(module, batches)
    got = {k.removeprefix("net."): v for k, v in module.torch_state_dict().items()}
    for name, value in _torch_weights(batches, loss).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
