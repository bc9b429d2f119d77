"""JaxModule.from_lightning under manual optimization (``automatic_optimization = False``):
GANs, hand-stepped schedulers and clipping, against the same module in plain Lightning."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell._errors import ConfigError

N_BATCHES = 6


class GAN(L.LightningModule):
    """Lightning's docs' GAN pattern: two optimizers, toggled, the noise from the batch.

    ``kind``: "toggle" (toggle_optimizer/untoggle_optimizer around each part), "plain" (no
    toggles: the generator's backward leaves gradients in the discriminator, zeroed by
    ``opt_d.zero_grad()``), "sched-clip" (clip_gradients and schedulers stepped by hand).
    """

    def __init__(self, kind: str = "toggle") -> None:
        super().__init__()
        self.kind = kind
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
        self.disc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.gen(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        ones = torch.ones(real.shape[0], 1, device=real.device)
        zeros = torch.zeros(real.shape[0], 1, device=real.device)
        toggle = self.kind != "plain"
        # generator
        if toggle:
            self.toggle_optimizer(opt_g)
        fake = self(z)
        g_loss = F.binary_cross_entropy_with_logits(self.disc(fake), ones)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        if self.kind == "sched-clip":
            self.clip_gradients(opt_g, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        if toggle:
            self.untoggle_optimizer(opt_g)
        # discriminator: sees the generator after its step
        if toggle:
            self.toggle_optimizer(opt_d)
        fake = self(z).detach()
        d_loss = 0.5 * (
            F.binary_cross_entropy_with_logits(self.disc(real), ones)
            + F.binary_cross_entropy_with_logits(self.disc(fake), zeros)
        )
        self.log("d_loss", d_loss)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        if self.kind == "sched-clip":
            self.clip_gradients(opt_d, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        opt_d.step()
        if toggle:
            self.untoggle_optimizer(opt_d)
        if self.kind == "sched-clip":
            sch_g, sch_d = self.lr_schedulers()
            sch_g.step()
            sch_d.step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.gen.parameters(), lr=2e-2, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.disc.parameters(), lr=0.1, momentum=0.9)
        if self.kind != "sched-clip":
            return [opt_g, opt_d], []
        sch_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
        sch_d = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda s: 1.0 / (1.0 + s))
        return [opt_g, opt_d], [sch_g, sch_d]


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    real = torch.randn(8 * N_BATCHES, 6, generator=g) * 0.5 + 1.0
    z = torch.randn(8 * N_BATCHES, 4, generator=g)
    return DataLoader(TensorDataset(real, z), batch_size=8)


def _trainer(tmp_path: Path, logger: Logger, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": logger,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return L.Trainer(**{**options, **kwargs})


def _weights(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", ["toggle", "plain", "sched-clip"])
def test_gan_matches_lightning_step_for_step(kind: str, tmp_path: Path) -> None:
    plain, ported = GAN(kind), GAN(kind)
    rows_plain, rows_ported = Recorder(), Recorder()
    t_plain = _trainer(tmp_path / "plain", rows_plain)
    t_plain.fit(plain, _loader())
    t_ported = _trainer(tmp_path / "ported", rows_ported)
    t_ported.fit(JaxModule.from_lightning(ported), _loader())
    # two optimizers stepped per batch: global_step counts both, as in Lightning
    assert t_plain.global_step == t_ported.global_step == 2 * N_BATCHES
    for name in ("g_loss", "d_loss"):
        ours, theirs = rows_ported.series(name), rows_plain.series(name)
        assert len(ours) == len(theirs) == N_BATCHES, (name, len(ours), len(theirs))
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6)
    start = _weights(GAN(kind))
    trained, reference = _weights(ported), _weights(plain)
    for k, v in reference.items():
        np.testing.assert_allclose(trained[k], v, rtol=2e-5, atol=2e-6, err_msg=k)
        assert not np.allclose(v, start[k]), k  # (it trained)


class EveryN(GAN):
    """Manual accumulation: stepping on a condition of batch_idx."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        _real, z = batch
        opt_g, _ = self.optimizers()
        loss = self.disc(self(z)).mean()
        self.manual_backward(loss)
        if (batch_idx + 1) % 2 == 0:
            opt_g.step()
            opt_g.zero_grad()


def test_stepping_on_batch_idx_is_refused_before_training(tmp_path: Path) -> None:
    module = EveryN()
    before = copy.deepcopy(_weights(module))
    with pytest.raises(ConfigError, match=r"batch_idx.*accumulate_grad_batches"):
        _trainer(tmp_path, Recorder()).fit(JaxModule.from_lightning(module), _loader())
    after = _weights(module)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _close(ours: Any, theirs: Any, where: str) -> None:
    """Nested checkpoint values equal (tensors and floats to float32 rounding)."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), (where, sorted(ours), sorted(theirs))
        for k in theirs:
            _close(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _close(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor | float):
        a, b = np.asarray(torch.as_tensor(ours)), np.asarray(torch.as_tensor(theirs))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=where)
    elif not callable(theirs):
        assert ours == theirs, (where, ours, theirs)


def test_checkpoint_holds_every_optimizer_and_scheduler_as_lightning(tmp_path: Path) -> None:
    plain, ported = GAN("sched-clip"), GAN("sched-clip")
    t_plain = _trainer(tmp_path / "plain", Recorder())
    t_plain.fit(plain, _loader())
    t_ported = _trainer(tmp_path / "ported", Recorder())
    t_ported.fit(JaxModule.from_lightning(ported), _loader())
    t_plain.save_checkpoint(tmp_path / "plain.ckpt")
    t_ported.save_checkpoint(tmp_path / "ported.ckpt")
    theirs = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    ours = torch.load(tmp_path / "ported.ckpt", weights_only=False)
    assert ours["global_step"] == theirs["global_step"] == 2 * N_BATCHES
    _close(ours["optimizer_states"], theirs["optimizer_states"], "optimizer_states")
    _close(ours["lr_schedulers"], theirs["lr_schedulers"], "lr_schedulers")
    # plain Lightning loads and resumes from it
    resumed = GAN.load_from_checkpoint(tmp_path / "ported.ckpt", kind="sched-clip")
    trainer = _trainer(tmp_path / "resume", Recorder(), max_epochs=2)
    trainer.fit(resumed, _loader(), ckpt_path=tmp_path / "ported.ckpt")
    assert trainer.global_step == 4 * N_BATCHES


class WithHooks(GAN):
    """Overrides hooks Lightning does not run under manual optimization."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not run under manual optimization")

    def on_before_zero_grad(self, optimizer: Any) -> None:
        raise AssertionError("not run under manual optimization")


class AfterBackward(GAN):
    """Overrides a hook Lightning runs inside manual_backward."""

    def on_after_backward(self) -> None:
        pass


def test_hooks_lightning_skips_under_manual_are_skipped_others_refused(tmp_path: Path) -> None:
    plain, ported = GAN("toggle"), WithHooks("toggle")
    _trainer(tmp_path / "plain", Recorder()).fit(plain, _loader())
    _trainer(tmp_path / "ported", Recorder()).fit(JaxModule.from_lightning(ported), _loader())
    reference, trained = _weights(plain), _weights(ported)
    for k, v in reference.items():
        np.testing.assert_allclose(trained[k], v, rtol=2e-5, atol=2e-6, err_msg=k)
    with pytest.raises(ConfigError, match=r"on_after_backward.*manual optimization.*Fix"):
        _trainer(tmp_path / "refused", Recorder()).fit(
            JaxModule.from_lightning(AfterBackward()), _loader()
        )
