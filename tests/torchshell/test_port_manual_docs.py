"""Manual optimization as Lightning's own docs and examples write it, through
``JaxModule.from_lightning``, step for step against plain Lightning.

The modules follow docs/source-pytorch/model/manual_optimization.rst (Lightning 2.6), the
docstrings of ``manual_backward``/``toggled_optimizer``/``clip_gradients`` and
examples/pytorch/domain_templates/generative_adversarial_net.py, written as there; where the
docs draw noise (``torch.randn``) it comes from the batch, so both frameworks see the same.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell.port_helpers import net
from tests.torchshell.test_port import Recorder
from tests.torchshell.test_port_manual import _trainer, _weights
from torchshell import JaxModule
from torchshell._errors import ConfigError

N = 2  # the docs' N (accumulation, scheduler every N epochs)


def _data(n_batches: int = 6) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * n_batches, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _gan_data(n_batches: int = 6, latent: int = 8) -> DataLoader:
    """Images and their noise: the docs draw ``z`` in training_step; here the batch holds it."""
    g = torch.Generator().manual_seed(2)
    imgs = torch.tanh(torch.randn(8 * n_batches, 1, 4, 4, generator=g) + 0.5)
    z = torch.randn(8 * n_batches, latent, generator=g)
    return DataLoader(TensorDataset(imgs, z), batch_size=8)


def _fit_both(
    make: Any,
    loader: Any,
    names: tuple[str, ...],
    tmp_path: Path,
    noise: dict[str, float] | None = None,
    **trainer: Any,
) -> tuple[L.LightningModule, L.Trainer, L.Trainer]:
    """Fits ``make()`` in plain Lightning and through from_lightning; asserts every logged
    value of ``names`` (at the same steps) and every final weight equal.

    ``noise``: weights whose gradient is zero in exact arithmetic (a Linear's bias right
    before a BatchNorm), with the bound on how far apart they may end: Adam normalises the
    gradient's rounding noise to an update of up to ``lr`` per step, whatever its size, in
    either framework.
    """
    noise = noise or {}
    plain, ported = make(), make()
    start = _weights(make())
    rows_plain, rows_ported = Recorder(), Recorder()
    t_plain = _trainer(tmp_path / "plain", rows_plain, **trainer)
    t_plain.fit(plain, loader())
    t_ported = _trainer(tmp_path / "ported", rows_ported, **trainer)
    t_ported.fit(JaxModule.from_lightning(ported), loader())
    assert t_ported.global_step == t_plain.global_step
    for name in names:
        theirs = [(s, m[name]) for s, m in rows_plain.rows if name in m]
        ours = [(s, m[name]) for s, m in rows_ported.rows if name in m]
        assert theirs, name
        assert [s for s, _ in ours] == [s for s, _ in theirs], name
        np.testing.assert_allclose(
            [v for _, v in ours], [v for _, v in theirs], rtol=2e-5, atol=2e-6, err_msg=name
        )
    reference, trained = _weights(plain), _weights(ported)
    assert set(trained) == set(reference)
    for k, v in reference.items():
        atol = noise.get(k, 2e-6)
        np.testing.assert_allclose(trained[k], v, rtol=2e-5, atol=atol, err_msg=k)
    assert any(not np.allclose(v, start[k]) for k, v in reference.items())  # (it trained)
    return ported, t_plain, t_ported


class Classifier(L.LightningModule):
    """The docs' ``compute_loss`` on a small classifier; the patterns override training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = net()

    def compute_loss(self, batch: Any) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Minimal(Classifier):
    """The docs' minimal example."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        opt.step()


class Clipped(Classifier):
    """The docs' gradient clipping (and ``clip_gradients``' docstring)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()

        # compute loss
        loss = self.compute_loss(batch)

        opt.zero_grad()
        self.manual_backward(loss)

        # clip gradients
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")

        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=3e-2)


class Closure(Classifier):
    """The docs' closure (``opt.step(closure=closure)``), with an optimizer that maps."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()

        def closure() -> Tensor:
            loss = self.compute_loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)


class Toggled(Classifier):
    """``toggled_optimizer``'s docstring: the context manager around one optimizer's step."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        with self.toggled_optimizer(opt):
            loss = self.compute_loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()


class EveryStep(Classifier):
    """The docs' ``lr_scheduler.step()`` every step (a single scheduler)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.compute_loss(batch))
        opt.step()

        # single scheduler
        sch = self.lr_schedulers()
        sch.step()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [scheduler]


class EveryNEpochs(EveryStep):
    """The docs' "step every N epochs": a condition on the Trainer's host values."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.compute_loss(batch))
        opt.step()

        sch = self.lr_schedulers()

        # step every N epochs
        if self.trainer.is_last_batch and (self.trainer.current_epoch + 1) % N == 0:
            sch.step()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        return [optimizer], [scheduler]


class EpochEnd(EveryNEpochs):
    """The docs' scheduler stepped in on_train_epoch_end (there ReduceLROnPlateau's form),
    with one that takes no value: a host hook moving the compiled step's schedule."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.compute_loss(batch))
        opt.step()

    def on_train_epoch_end(self) -> None:
        sch = self.lr_schedulers()

        sch.step()


@pytest.mark.parametrize(
    "make", [Minimal, Clipped, Closure, Toggled, EveryStep], ids=lambda m: m.__name__
)
def test_one_optimizer_patterns_match_lightning(make: Any, tmp_path: Path) -> None:
    _fit_both(make, _data, ("train_loss",), tmp_path, max_epochs=2)


def test_scheduler_stepped_every_n_epochs_on_is_last_batch(tmp_path: Path) -> None:
    _, t_plain, _ = _fit_both(EveryNEpochs, _data, ("train_loss",), tmp_path, max_epochs=5)
    # stepped after epochs 2 and 4: lr 1e-2 -> 1e-3 -> 1e-4, as in plain Lightning
    assert math.isclose(t_plain.lr_scheduler_configs[0].scheduler.get_last_lr()[0], 1e-4)


def test_scheduler_stepped_in_on_train_epoch_end(tmp_path: Path) -> None:
    _, _, t_ported = _fit_both(EpochEnd, _data, ("train_loss",), tmp_path, max_epochs=3)
    t_ported.save_checkpoint(tmp_path / "ported.ckpt")
    ckpt = torch.load(tmp_path / "ported.ckpt", weights_only=False)
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 3  # (stepped after each epoch)


# -- several optimizers: the docs' SimpleGAN and Lightning's GAN example ----------------------
class Generator(nn.Module):
    """The example's generator (its blocks, BatchNorm1d(out, 0.8), LeakyReLU in place), small."""

    def __init__(self, latent_dim: int = 8, img_shape: tuple[int, ...] = (1, 4, 4)) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 16, normalize=False),
            *block(16, 32),
            nn.Linear(32, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...] = (1, 4, 4)) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 32),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 16),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(16, 1),
        )

    def forward(self, img: Tensor) -> Tensor:
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class ExampleGAN(L.LightningModule):
    """examples/pytorch/domain_templates/generative_adversarial_net.py, noise from the batch."""

    def __init__(
        self,
        img_shape: tuple = (1, 4, 4),
        lr: float = 0.002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        torch.manual_seed(0)
        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)
        self.validation_z = torch.randn(8, self.hparams.latent_dim)
        self.samples: list[Tensor] = []

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch: Any) -> None:  # (the example takes no batch_idx)
        imgs, z = batch

        opt_g, opt_d = self.optimizers()

        # sample noise (the example: torch.randn(imgs.shape[0], self.hparams.latent_dim))
        z = z.type_as(imgs)

        # Train generator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self) -> None:
        z = self.validation_z.type_as(self.generator.model[0].weight)

        # the example logs a grid of these images
        self.samples.append(self(z).detach().clone())


class SimpleGAN(L.LightningModule):
    """The docs' SimpleGAN: the discriminator first, ``g_X.detach()``, ``self.log_dict``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # (the docs leave Generator() undefined: an MLP)
        self.G = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.Tanh())
        self.D = Discriminator()
        self.criterion = nn.BCEWithLogitsLoss()

        # Important: This property activates manual optimization.
        self.automatic_optimization = False

    def sample_G(self, z: Tensor) -> Tensor:  # (the docs: self.G(self.sample_z(n)))
        return self.G(z).view(z.size(0), 1, 4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()

        X, z = batch
        batch_size = X.shape[0]

        real_label = torch.ones((batch_size, 1), device=self.device)
        fake_label = torch.zeros((batch_size, 1), device=self.device)

        g_X = self.sample_G(z)

        ##########################
        # Optimize Discriminator #
        ##########################
        d_x = self.D(X)
        errD_real = self.criterion(d_x, real_label)

        d_z = self.D(g_X.detach())
        errD_fake = self.criterion(d_z, fake_label)

        errD = errD_real + errD_fake

        d_opt.zero_grad()
        self.manual_backward(errD)
        d_opt.step()

        ######################
        # Optimize Generator #
        ######################
        d_z = self.D(g_X)
        errG = self.criterion(d_z, real_label)

        g_opt.zero_grad()
        self.manual_backward(errG)
        g_opt.step()

        self.log_dict({"g_loss": errG, "d_loss": errD}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.Adam(self.G.parameters(), lr=1e-2)
        d_opt = torch.optim.Adam(self.D.parameters(), lr=1e-2)
        return g_opt, d_opt


def test_lightning_gan_example_matches_lightning(tmp_path: Path) -> None:
    steps = 2 * 6  # (Adam: lr 0.002 per step at most, 12 generator steps)
    # (the running mean holds that bias: the same bound)
    noise = {f"generator.model.{k}": 0.002 * steps for k in ("2.bias", "3.running_mean")}
    ported, _, t_ported = _fit_both(
        ExampleGAN, _gan_data, ("g_loss", "d_loss"), tmp_path, noise, max_epochs=2
    )
    assert t_ported.global_step == 2 * 2 * 6  # two opt.step() per batch
    # BatchNorm's running statistics (updated by both generator passes in each step, and
    # by the epoch-end sampling in train mode, on the host) and the epoch-end samples
    assert len(ported.samples) == 2
    assert torch.isfinite(ported.samples[-1]).all()
    plain = ExampleGAN()
    _trainer(tmp_path / "again", Recorder(), max_epochs=2).fit(plain, _gan_data())
    for ours, theirs in zip(ported.samples, plain.samples, strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=2e-5, atol=2e-6)


def test_docs_simple_gan_matches_lightning(tmp_path: Path) -> None:
    _, _, t_ported = _fit_both(SimpleGAN, _gan_data, ("g_loss", "d_loss"), tmp_path)
    assert t_ported.progress_bar_metrics.keys() >= {"g_loss", "d_loss"}


# -- refused before training, naming what and the fix ----------------------------------------
class Accumulating(Classifier):
    """The docs' gradient accumulation, written as there."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()

        # scale losses by 1/N (for N batches of gradient accumulation)
        loss = self.compute_loss(batch) / N
        self.manual_backward(loss)

        # accumulate gradients of N batches
        if (batch_idx + 1) % N == 0:
            opt.step()
            opt.zero_grad()


class SchedulerEveryNBatches(EveryStep):
    """The docs' "step every N batches"."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.compute_loss(batch))
        opt.step()
        sch = self.lr_schedulers()
        # step every N batches
        if (batch_idx + 1) % N == 0:
            sch.step()


class DiscriminatorEveryOther(SimpleGAN):
    """The docs' "optimizer steps at different frequencies"."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        X, z = batch
        ones = torch.ones((X.shape[0], 1), device=self.device)
        g_X = self.sample_G(z)
        errD = self.criterion(self.D(X), ones) + self.criterion(self.D(g_X.detach()), 0 * ones)

        # update discriminator every other step
        d_opt.zero_grad()
        self.manual_backward(errD)
        if (batch_idx + 1) % 2 == 0:
            d_opt.step()

        # update generator every step
        errG = self.criterion(self.D(g_X), ones)
        g_opt.zero_grad()
        self.manual_backward(errG)
        g_opt.step()


class Plateau(Minimal):
    """The docs' scheduler that needs a metric, stepped in on_train_epoch_end."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=0.1, patience=10
        )
        return [optimizer], [scheduler]

    def on_train_epoch_end(self) -> None:
        sch = self.lr_schedulers()

        sch.step(self.trainer.callback_metrics["train_loss"])


@pytest.mark.parametrize(
    ("make", "loader", "match"),
    [
        (Accumulating, _data, r"batch_idx.*accumulate_grad_batches"),
        (SchedulerEveryNBatches, _data, r"batch_idx.*Fix"),
        (DiscriminatorEveryOther, _gan_data, r"batch_idx.*Fix"),
        (Plateau, _data, r"ReduceLROnPlateau.*manual optimization.*Fix"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_docs_patterns_refused_before_training(
    make: Any, loader: Any, match: str, tmp_path: Path
) -> None:
    module = make()
    before = copy.deepcopy(_weights(module))
    # (plain Lightning trains each of them)
    _trainer(tmp_path / "plain", Recorder()).fit(make(), loader())
    with pytest.raises(ConfigError, match=match):
        _trainer(tmp_path, Recorder()).fit(JaxModule.from_lightning(module), loader())
    after = _weights(module)
    assert all(np.array_equal(before[k], after[k]) for k in before)
