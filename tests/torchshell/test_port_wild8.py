"""JaxModule.from_lightning / from_torch on what issue #52 found (round 8): a training batch
of another form than the validation batch (SimCLR's two views), a torch loss written with
tensor methods only, a submodule reachable under two names (locuslab's TCN), and
``LearningRateMonitor(log_momentum=True)`` under OneCycleLR. Each runs in plain Lightning (or
torch) and through coreshell on the same loaders, step for step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell.port_helpers import agree
from tests.torchshell.test_port_wild3 import _pair, _trainer
from torchshell import JaxModule
from torchshell._errors import ConfigError


class TwoViews(L.LightningModule):
    """SimCLR's shape: training batches ``(x1, x2, y)``, validation batches ``(x, y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x1, x2, y = batch
        z1, z2 = self.enc(x1), self.enc(x2)
        loss = F.mse_loss(z1, z2) + F.cross_entropy(self.head(z1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.head(self.enc(x)), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _views(n: int, seed: int, views: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 8, generator=g) for _ in range(views)]
    return DataLoader(TensorDataset(*xs, torch.randint(0, 3, (n,), generator=g)), batch_size=16)


def test_training_batch_of_another_form_than_validation_batch(tmp_path: Path) -> None:
    # was: the sanity check traced training_step on a validation batch (x, y): "not enough
    # values to unpack (expected 3, got 2)" in the user's own step, before training
    runs = _pair(TwoViews, tmp_path, _views(64, 0, 2), _views(32, 1, 1))
    agree(runs, ("train_loss", "val_loss"), rtol=1e-4)


class TwoViewsManual(TwoViews):
    """The same under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x1, x2, y = batch
        z1, z2 = self.enc(x1), self.enc(x2)
        loss = F.mse_loss(z1, z2) + F.cross_entropy(self.head(z1), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize(
    ("make", "flags"),
    [(TwoViewsManual, {}), (TwoViews, {"accumulate_grad_batches": 2})],
    ids=["manual", "accumulate"],
)
def test_two_views_manual_or_accumulated(tmp_path: Path, make: Any, flags: Any) -> None:
    runs = _pair(make, tmp_path, _views(64, 0, 2), _views(32, 1, 1), **flags)
    agree(runs, ("train_loss", "val_loss"), rtol=1e-4)


def test_validate_before_fit_never_traces_training_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = TwoViews()
    torch.manual_seed(0)
    user = TwoViews()
    module = JaxModule.from_lightning(user, print_summary=False)
    want = _trainer(tmp_path / "plain").validate(plain, _views(32, 1, 1), verbose=False)
    got = _trainer(tmp_path / "jax").validate(module, _views(32, 1, 1), verbose=False)
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], rel=1e-5)
    trainer = _trainer(tmp_path / "jax")
    trainer.fit(module, _views(64, 0, 2), _views(32, 1, 1))
    _trainer(tmp_path / "plain").fit(plain, _views(64, 0, 2), _views(32, 1, 1))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(user.state_dict()[name], value, rtol=1e-4, atol=1e-6)


class OneCycle(L.LightningModule):
    """SGD with momentum under OneCycleLR (which cycles ``momentum``), or Adam (``betas``)."""

    def __init__(self, adam: bool = False) -> None:
        super().__init__()
        self.adam = adam
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.adam:
            opt: Any = torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=1e-3)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8)
        return [opt], [{"scheduler": sched, "interval": "step"}]


@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adam"])
def test_learning_rate_monitor_logs_the_cycled_momentum(tmp_path: Path, adam: bool) -> None:
    # was: lr-SGD-momentum stayed at 0.95 while OneCycleLR cycled it (only lr was copied back)
    def monitor() -> list[Any]:
        return [LearningRateMonitor("step", log_momentum=True, log_weight_decay=True)]

    runs = _pair(lambda: OneCycle(adam), tmp_path, _views(64, 0, 1), callbacks=monitor)
    name = "Adam" if adam else "SGD"
    series = (f"lr-{name}", f"lr-{name}-momentum", f"lr-{name}-weight_decay", "train_loss")
    agree(runs, series, rtol=1e-4)
    momenta = runs["jax"][0].logger.series(f"lr-{name}-momentum")
    assert len(set(momenta)) > 3  # cycled, as in plain Lightning


# -- from_torch ------------------------------------------------------------------------------
class TCNBlock(nn.Module):
    """locuslab's TCN block: ``self.conv1`` is also ``self.net[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3, padding=1)
        self.net = nn.Sequential(self.conv1, nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(-1, 2, 8))


class TwiceLinear(nn.Module):
    """One ``nn.Linear`` used twice under two attribute names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _table(n: int = 48, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=16)


def _torch_parity(make: Any, loss: Any, loader: DataLoader, tmp_path: Path) -> nn.Module:
    """``make()`` trained 2 epochs of SGD in plain torch and through from_torch: the same
    weights; the user's module works (``net(x)``) after from_torch and after the fit."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = make()
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    net, opt = build()
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss(net(x), y).backward()
            opt.step()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    x = next(iter(loader))[0]
    expected = net(x).detach()
    net, opt = build()
    before = net(x).detach()
    module = JaxModule.from_torch(net, loss, opt, print_summary=False)
    torch.testing.assert_close(net(x).detach(), before)  # was: torchax tensors in the module
    _trainer(tmp_path).fit(module, loader)
    for name, value in want.items():
        torch.testing.assert_close(net.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert all(type(p) is nn.Parameter for p in net.parameters())
    torch.testing.assert_close(net(x).detach(), expected, rtol=1e-4, atol=1e-5)
    return net


@pytest.mark.parametrize("make", [TCNBlock, TwiceLinear], ids=["tcn", "linear_twice"])
def test_from_torch_a_submodule_under_two_names(tmp_path: Path, make: Any) -> None:
    # was: the module held torchax tensors after the trace; the fit ended in a raw
    # RuntimeError from load_state_dict
    net = _torch_parity(make, nn.CrossEntropyLoss(), _table(), tmp_path)
    shared = (net.conv1, net.net[0]) if isinstance(net, TCNBlock) else (net.a, net.b)
    assert shared[0] is shared[1]


def _regression(n: int = 48, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def l1(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().mean()


def test_from_torch_a_loss_of_tensor_methods_only(tmp_path: Path) -> None:
    # was: taken for a JAX loss: "unsupported operand type(s) for -: 'LinearizeTracer' and 'dict'"
    _torch_parity(
        lambda: nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)),
        l1,
        _regression(),
        tmp_path,
    )


def jax_loss_torch_signature(out: Any, y: Any) -> Any:
    return jnp.abs(out - y).mean()


def torch_loss_jax_signature(out: Any, batch: Any) -> Any:
    return F.l1_loss(out, batch["y"])


@pytest.mark.parametrize(
    ("loss", "says"),
    [(jax_loss_torch_signature, "JAX loss"), (torch_loss_jax_signature, "torch loss")],
    ids=["jax_given_a_dict", "torch_given_a_batch"],
)
def test_from_torch_a_loss_of_the_other_kind_is_refused(
    tmp_path: Path, loss: Any, says: str
) -> None:
    net = nn.Linear(16, 3)
    module = JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    with pytest.raises(ConfigError, match=says) as info:
        _trainer(tmp_path, max_epochs=1).fit(module, _regression())
    assert "Fix:" in str(info.value)


class SharedLit(L.LightningModule):
    """A LightningModule whose encoder layer is also ``self.layers[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.layers = nn.Sequential(self.first, nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SharedLitManual(SharedLit):
    """The same under manual optimization (``manual_backward``: a trace inside a trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("make", [SharedLit, SharedLitManual], ids=["automatic", "manual"])
def test_from_lightning_a_submodule_under_two_names(tmp_path: Path, make: Any) -> None:
    # was: "first.weight, first.bias frozen (requires_grad changed) before epoch 1": the
    # trace left torchax tensors in the user's module
    runs = _pair(make, tmp_path, _table())
    agree(runs, rtol=1e-4)
    user = runs["jax"][1]
    assert user.first is user.layers[0]
    x = next(iter(_table()))[0]
    torch.testing.assert_close(user(x), runs["plain"][1](x), rtol=1e-4, atol=1e-5)
